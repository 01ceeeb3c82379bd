"""Quantized jax.lax.ragged_dot: the grouped matmul of mixture-of-experts layers.

Lingo: lhs [m, k] rows are split into consecutive groups by `group_sizes` [g]; rhs [g, k, n] holds
one [k, n] matrix per group; out [m, n] row i is lhs[i] · rhs[group of i].

native path  both operands are QArrays of uniform qtypes without zero points whose scales are
             constant along k (lhs [m | 1, 1], rhs [g | 1, 1, n | 1]): the codes are multiplied
             (int8 → int32, fp8 → f32) and the scales applied to the output. A per-group rhs
             scale differs by output row; it is laid out along the rows by a second ragged_dot
             of ones [m, 1] with the scale [g, 1, n], which selects each row's group exactly.
fallback     anything else is dequantized first; integer × integer accumulates in int32.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from qmill.engine.core import qarray
from qmill.engine.ops import dot_general as dot_general_lib


def get_how_to_quantize(
    *,
    for_lhs: bool,
    qtype: Any,
    tile_size: int | float | None = None,
    calibration_method: str = "absmax",
) -> qarray.HowToQuantize:
    """lhs [m, k]: a scale per row; rhs [g, k, n]: a scale per (group, column); k tiled by
    `tile_size` when given (that operand then takes the dequantizing path)."""
    return qarray.HowToQuantize(
        qtype=qtype,
        channelwise_axes=(0,) if for_lhs else (0, 2),
        tiled_axes={1: tile_size} if tile_size else {},
        calibration_method=calibration_method,
    )


def _native_ok(lhs: Any, rhs: Any) -> bool:
    return (
        dot_general_lib._native_pair(lhs, rhs)
        and lhs.ndim == 2
        and rhs.ndim == 3
        and lhs.scale.shape[1] == 1
        and rhs.scale.shape[1] == 1
    )


def _optional(group_offset: Any) -> dict[str, Any]:
    return {} if group_offset is None else {"group_offset": group_offset}


def _native(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset):
    lq, rq, acc = dot_general_lib.native_codes(lhs, rhs, lhs.qvalue, rhs.qvalue)
    extra = _optional(group_offset)
    out = jax.lax.ragged_dot(
        lq, rq, group_sizes, precision=precision, preferred_element_type=acc, **extra
    )
    out = out.astype(jnp.float32) * lhs.scale.astype(jnp.float32)  # [m | 1, 1]
    rs = rhs.scale.astype(jnp.float32)
    if rs.shape[0] == 1:
        out = out * rs[0]  # [1, n | 1]
    else:
        ones = jnp.ones((out.shape[0], 1), jnp.float32)
        out = out * jax.lax.ragged_dot(ones, rs, group_sizes, **extra)  # each row's group scale
    dtype = preferred_element_type or jnp.result_type(lhs.scale.dtype, rhs.scale.dtype)
    return out.astype(dtype)


def ragged_dot(
    lhs: jax.Array | qarray.QArray,
    rhs: jax.Array | qarray.QArray,
    group_sizes: jax.Array,
    precision: Any = None,
    preferred_element_type: Any = None,
    group_offset: jax.Array | None = None,
) -> jax.Array:
    """jax.lax.ragged_dot accepting QArrays; see the module docstring for the paths taken."""
    if _native_ok(lhs, rhs):
        return _native(lhs, rhs, group_sizes, precision, preferred_element_type, group_offset)
    a, b, preferred_element_type = dot_general_lib.plain_operands(lhs, rhs, preferred_element_type)
    return jax.lax.ragged_dot(
        a,
        b,
        group_sizes,
        precision=precision,
        preferred_element_type=preferred_element_type,
        **_optional(group_offset),
    )


def ragged_dot_general(
    lhs: jax.Array | qarray.QArray,
    rhs: jax.Array | qarray.QArray,
    group_sizes: jax.Array,
    ragged_dot_dimension_numbers: jax.lax.RaggedDotDimensionNumbers,
    precision: Any = None,
    preferred_element_type: Any = None,
    group_offset: jax.Array | None = None,
) -> jax.Array:
    """jax.lax.ragged_dot_general accepting QArrays (dequantized first: its layouts vary too
    much for one native path; ragged_dot's common layout has one)."""
    a, b, preferred_element_type = dot_general_lib.plain_operands(lhs, rhs, preferred_element_type)
    return jax.lax.ragged_dot_general(
        a,
        b,
        group_sizes,
        ragged_dot_dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
        **_optional(group_offset),
    )
