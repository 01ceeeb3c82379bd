"""Quantized two-operand einsum, lowered to ops.dot_general.

Lingo: in "bij,bjk->bik", letters in both operands and the output are batch axes (b), letters in
both operands only are contracted (j), the others are free (i, k). The dot_general output order
is (batch, lhs free, rhs free), transposed to the einsum's output order afterwards.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from qmill.engine import qarray
from qmill.engine.ops import dot_general as dot_general_lib


@dataclasses.dataclass(frozen=True)
class _Plan:
    # dot_general dimension numbers.
    dimension_numbers: tuple
    # Permutation from the dot_general output to the einsum output.
    permutation: tuple[int, ...]


@functools.cache
def _plan(einsum_str: str, lhs_ndim: int, rhs_ndim: int) -> _Plan:
    spec = einsum_str.replace(" ", "")
    if "..." in spec:
        raise ValueError(f"einsum {einsum_str!r}: ellipsis is not supported for quantized einsum")
    inputs, arrow, out = spec.partition("->")
    parts = inputs.split(",")
    if len(parts) != 2:
        raise ValueError(f"einsum {einsum_str!r}: quantized einsum takes exactly two operands")
    lhs, rhs = parts
    if len(lhs) != lhs_ndim or len(rhs) != rhs_ndim:
        raise ValueError(
            f"einsum {einsum_str!r} does not match operand ranks ({lhs_ndim}, {rhs_ndim})"
        )
    if not arrow:  # implicit output: letters appearing once, sorted
        out = "".join(sorted(c for c in set(lhs + rhs) if (lhs + rhs).count(c) == 1))
    for side in (lhs, rhs):
        lonely = [c for c in side if c not in out and c not in (rhs if side is lhs else lhs)]
        if lonely or len(set(side)) != len(side):
            raise ValueError(
                f"einsum {einsum_str!r}: axes summed within one operand or repeated letters are "
                "not supported for quantized einsum"
            )
    batch = [c for c in lhs if c in rhs and c in out]
    contract = [c for c in lhs if c in rhs and c not in out]
    lfree = [c for c in lhs if c not in rhs]
    rfree = [c for c in rhs if c not in lhs]
    dims = (
        (tuple(lhs.index(c) for c in contract), tuple(rhs.index(c) for c in contract)),
        (tuple(lhs.index(c) for c in batch), tuple(rhs.index(c) for c in batch)),
    )
    produced = batch + lfree + rfree
    return _Plan(dims, tuple(produced.index(c) for c in out))


def get_how_to_quantize(
    *, einsum_str: str, ndims: tuple[int, int], **how: Any
) -> qarray.HowToQuantize:
    """As dot_general.get_how_to_quantize, for the dot_general this einsum lowers to.

    Args:
      einsum_str: the two-operand einsum ("bij,bjk->bik").
      ndims: the ranks of its operands.
      **how: for_lhs, qtype, tile_size and calibration_method, as dot_general takes them.
    """
    dimension_numbers = _plan(einsum_str, *ndims).dimension_numbers
    return dot_general_lib.get_how_to_quantize(
        dimension_numbers=dimension_numbers, ndims=ndims, **how
    )


def einsum(
    einsum_str: str,
    lhs: jax.Array | qarray.QArray,
    rhs: jax.Array | qarray.QArray,
    *,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """Two-operand einsum accepting QArrays (no ellipsis, no within-operand sums)."""
    plan = _plan(einsum_str, len(lhs.shape), len(rhs.shape))
    out = dot_general_lib.dot_general(
        lhs,
        rhs,
        plan.dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
    return jnp.transpose(out, plan.permutation)
