"""Quantized jnp.dot: a[..., k] · b[..., k, n] (or b[k]) lowered to ops.dot_general."""

from __future__ import annotations

from typing import Any

import jax

from qmill.engine.core import qarray
from qmill.engine.ops import dot_general as dot_general_lib


def dimension_numbers(lhs_ndim: int, rhs_ndim: int) -> dot_general_lib.DimensionNumbers:
    """jnp.dot's contraction: lhs's last axis with rhs's last (1-D) or second-to-last axis."""
    if lhs_ndim == 0 or rhs_ndim == 0:
        raise ValueError("quantized dot needs operands of rank >= 1 (use a multiply for scalars)")
    rhs_axis = 0 if rhs_ndim == 1 else rhs_ndim - 2
    return ((lhs_ndim - 1,), (rhs_axis,)), ((), ())


def dot(
    a: jax.Array | qarray.QArray,
    b: jax.Array | qarray.QArray,
    *,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """jnp.dot accepting QArrays."""
    return dot_general_lib.dot_general(
        a,
        b,
        dimension_numbers(len(a.shape), len(b.shape)),
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
