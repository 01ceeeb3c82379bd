"""Block-scaled (microscaling) dot_general: both operands in an mx / nv format.

mxfp8 / mxfp4 / nvfp4 values share one scale per block of 32 (16 for mxfp8_16 / nvfp4) along
the contraction. When both sides are such QArrays and their blocks line up, the product is
computed block by block on the codes: each block pair is one small matmul whose result is
multiplied by the two block scales, then the blocks are summed (ops.dot_general's split
contraction). The e4m3 and e2m1 codes are exact in bfloat16, which the matmul takes; products
accumulate in float32.

`mxfp_dot_general` is the reference's dispatcher: on a GPU it returns that product, and None
on any other platform (the reference's hardware path, jax.nn.scaled_matmul, lowers on GPUs
only) or for operands it doesn't take, telling the caller to fall back to ops.dot_general,
which dequantizes. `block_scaled_dot_general` computes the product on every platform.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from qmill.engine.core import qarray, qtypes
from qmill.engine.ops import dot_general as dot_general_lib

# The block-scaled formats: those whose qtype requires a tile (mxfp8, mxfp8_16, mxfp4, nvfp4).
MX_QTYPES = tuple(n for n in qtypes.names() if qtypes.get(n).required_tile is not None)


def _is_mx(x: Any) -> bool:
    return isinstance(x, qarray.QArray) and x.qtype in MX_QTYPES and x.zero_point is None


def _blocks_only_along(x: qarray.QArray, contracting: tuple[int, ...]) -> bool:
    """Scale entries vary across blocks only on contracting axes (elsewhere: any channelwise)."""
    tiles = x.scale_tile_shape
    return all(
        t == 1 or t == n or a in contracting
        for a, (t, n) in enumerate(zip(tiles, x.shape, strict=True))
    )


@functools.cache
def _get_primary_platform() -> str:
    """The first device's platform, looked up once (cache_clear() after the devices change)."""
    return jax.devices()[0].platform


def mxfp_dot_general(
    lhs: Any,
    rhs: Any,
    dimension_numbers: dot_general_lib.DimensionNumbers,
    preferred_element_type: Any = None,
) -> jax.Array | None:
    """The block-scaled product of two mx / nv QArrays on a GPU; None on other platforms or when
    it doesn't apply (the caller falls back to ops.dot_general), as the reference."""
    if _get_primary_platform() != "gpu":
        return None
    return block_scaled_dot_general(lhs, rhs, dimension_numbers, preferred_element_type)


def block_scaled_dot_general(
    lhs: Any,
    rhs: Any,
    dimension_numbers: dot_general_lib.DimensionNumbers,
    preferred_element_type: Any = None,
) -> jax.Array | None:
    """The block-scaled product of two mx / nv QArrays on any platform, or None when it doesn't
    apply."""
    if not (_is_mx(lhs) and _is_mx(rhs)):
        return None
    dims = dot_general_lib._normalize(dimension_numbers, lhs.ndim, rhs.ndim)
    (lc, rc), _ = dims
    if not (_blocks_only_along(lhs, lc) and _blocks_only_along(rhs, rc)):
        return None
    for a_l, a_r in zip(lc, rc, strict=True):
        if lhs.scale_tile_shape[a_l] != rhs.scale_tile_shape[a_r]:
            return None  # blocks of different sizes: no per-block product
    split = dot_general_lib._split_contracting(lhs, rhs, dims)
    if split is None:
        return None
    lq, ls, rq, rs, dims2, n_blocks = split
    lq, rq = lq.astype(jnp.bfloat16), rq.astype(jnp.bfloat16)
    out = jax.lax.dot_general(lq, rq, dims2, preferred_element_type=jnp.float32)
    result = preferred_element_type or jnp.result_type(lhs.scale.dtype, rhs.scale.dtype)
    return dot_general_lib.scale_split_product(out, (lq, ls, rq, rs, dims2, n_blocks), result)


def is_mx_qtype(qtype: Any) -> bool:
    """Whether `qtype` is one of the block-scaled formats this op takes."""
    return qtypes.name(qtype) in MX_QTYPES


def _flatten_to_3d(
    operand: qarray.QArray, ca: Sequence[int], ba: Sequence[int]
) -> tuple[jax.Array, jax.Array]:
    """An mx operand's codes and scale as (batch, free, contracting) / (batch, free, blocks),
    the layout of jax.nn.scaled_matmul (the scale broadcast over batch and free axes first)."""
    free = [a for a in range(operand.ndim) if a not in ca and a not in ba]
    order = [*ba, *free, *ca]
    sizes = [math.prod(operand.shape[a] for a in axes) for axes in (ba, free)]
    qvalue = jnp.transpose(operand.qvalue, order).reshape(*sizes, -1)
    full = [operand.scale.shape[a] if a in ca else operand.shape[a] for a in range(operand.ndim)]
    scale = jnp.broadcast_to(operand.scale, full)
    return qvalue, jnp.transpose(scale, order).reshape(*sizes, -1)


def _unflatten_from_3d(
    out_3d: jax.Array,
    lhs: qarray.QArray,
    rhs: qarray.QArray,
    dimension_numbers: dot_general_lib.DimensionNumbers,
) -> jax.Array:
    """(batch, lhs free, rhs free) back to dot_general's output: batch, lhs free, rhs free axes."""
    (lc, rc), (lb, rb) = dimension_numbers
    batch = [lhs.shape[a] for a in lb]
    lhs_free = [lhs.shape[a] for a in range(lhs.ndim) if a not in lc and a not in lb]
    rhs_free = [rhs.shape[a] for a in range(rhs.ndim) if a not in rc and a not in rb]
    return out_3d.reshape(*batch, *lhs_free, *rhs_free)
