"""Quantized two-operand einsum, lowered to ops.dot_general.

Lingo: in "bij,bjk->bik", letters in both operands and the output are batch axes (b), letters in
both operands only are contracted (j), the others are free (i, k). The dot_general output order
is (batch, lhs free, rhs free), transposed to the einsum's output order afterwards.

Ellipsis ("...ab,...bc->...ac") stands for the leading axes each operand has beyond its letters;
as in numpy they are aligned from the right and a missing or size-1 axis broadcasts. A batch axis
of size 1 on one side only is squeezed from that side and becomes a free axis of the other:
dot_general then computes the broadcast product without materializing anything. A batch axis
whose size divides the other side's (4 vs 8) is repeated up to it, entry by entry (the
reference's generic broadcast).
"""

from __future__ import annotations

import dataclasses
import functools
import string
from typing import Any

import jax
import jax.numpy as jnp

from qmill.engine.core import qarray
from qmill.engine.ops import dot_general as dot_general_lib


@dataclasses.dataclass(frozen=True)
class _Plan:
    # dot_general dimension numbers (on the operands after `squeeze`).
    dimension_numbers: tuple
    # Permutation from the dot_general output to the einsum output.
    permutation: tuple[int, ...]
    # Size-1 axes removed from (lhs, rhs) before the dot_general (broadcast batch axes).
    squeeze: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    # Per side, the shape a batch axis whose size divides the other side's is repeated to.
    expand: tuple[tuple[int, ...] | None, tuple[int, ...] | None] = (None, None)


def _ellipsis_letters(spec: str, count: int) -> str:
    """`count` labels for ellipsis axes, none of them used in `spec`."""
    pool = [c for c in string.ascii_letters if c not in spec]
    pool += [chr(0x100 + i) for i in range(count)]  # beyond 52 axes: any distinct characters
    return "".join(pool[:count])


def _labels(einsum_str: str, lhs_ndim: int, rhs_ndim: int) -> tuple[str, str, str]:
    """(lhs, rhs, out) letters with any ellipsis expanded and the implicit output filled in."""
    spec = einsum_str.replace(" ", "")
    inputs, arrow, out = spec.partition("->")
    parts = inputs.split(",")
    if len(parts) != 2:
        raise ValueError(f"einsum {einsum_str!r}: quantized einsum takes exactly two operands")
    sides = []
    n_ell = []
    for part, ndim in zip(parts, (lhs_ndim, rhs_ndim), strict=True):
        if part.count("...") > 1 or "." in part.replace("...", ""):
            raise ValueError(f"einsum {einsum_str!r}: malformed ellipsis in {part!r}")
        n = ndim - len(part.replace("...", "")) if "..." in part else 0
        if n < 0 or ("..." not in part and len(part) != ndim):
            raise ValueError(
                f"einsum {einsum_str!r} does not match operand ranks ({lhs_ndim}, {rhs_ndim})"
            )
        sides.append(part)
        n_ell.append(n)
    ell = _ellipsis_letters(spec, max(n_ell))
    # Right-aligned, as numpy broadcasting: an operand with fewer ellipsis axes takes the last.
    lhs = sides[0].replace("...", ell[len(ell) - n_ell[0] :])
    rhs = sides[1].replace("...", ell[len(ell) - n_ell[1] :])
    if arrow:
        if "..." not in out and ell:
            raise ValueError(f"einsum {einsum_str!r}: the output must keep the ellipsis ('...')")
        out = out.replace("...", ell)
    else:  # implicit output: the ellipsis, then letters appearing once, sorted
        singles = sorted(c for c in set(lhs + rhs) if c not in ell and (lhs + rhs).count(c) == 1)
        out = ell + "".join(singles)
    return lhs, rhs, out


@functools.cache
def _plan(einsum_str: str, lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...]) -> _Plan:
    lhs, rhs, out = _labels(einsum_str, len(lhs_shape), len(rhs_shape))
    for side in (lhs, rhs):
        lonely = [c for c in side if c not in out and c not in (rhs if side is lhs else lhs)]
        if lonely or len(set(side)) != len(side):
            raise ValueError(
                f"einsum {einsum_str!r}: axes summed within one operand or repeated letters are "
                "not supported for quantized einsum"
            )
    # Shared letters whose sizes differ: a size-1 side broadcasts (squeezed there); a size that
    # divides the other's is repeated up to it, each entry over its block (the reference's
    # generic broadcast, e.g. 4 key/value heads shared by 8 query heads).
    squeeze_l, squeeze_r = [], []
    expand_l, expand_r = list(lhs_shape), list(rhs_shape)
    for c in lhs:
        if c not in rhs:
            continue
        il, ir = lhs.index(c), rhs.index(c)
        nl, nr = lhs_shape[il], rhs_shape[ir]
        if nl == nr:
            continue
        if c not in out or max(nl, nr) % min(nl, nr):
            raise ValueError(
                f"Cannot broadcast axis {c!r} of einsum {einsum_str!r}: sizes {nl} and {nr} "
                "(a batch axis broadcasts when one size divides the other)"
            )
        if 1 in (nl, nr):
            (squeeze_l if nl == 1 else squeeze_r).append(c)
        elif nl < nr:
            expand_l[il] = nr
        else:
            expand_r[ir] = nl
    lhs_k = "".join(c for c in lhs if c not in squeeze_l)
    rhs_k = "".join(c for c in rhs if c not in squeeze_r)
    batch = [c for c in lhs_k if c in rhs_k and c in out]
    contract = [c for c in lhs_k if c in rhs_k and c not in out]
    lfree = [c for c in lhs_k if c not in rhs_k]
    rfree = [c for c in rhs_k if c not in lhs_k]
    dims = (
        (tuple(lhs_k.index(c) for c in contract), tuple(rhs_k.index(c) for c in contract)),
        (tuple(lhs_k.index(c) for c in batch), tuple(rhs_k.index(c) for c in batch)),
    )
    produced = batch + lfree + rfree
    squeeze = (tuple(lhs.index(c) for c in squeeze_l), tuple(rhs.index(c) for c in squeeze_r))
    expand = (
        tuple(expand_l) if tuple(expand_l) != lhs_shape else None,
        tuple(expand_r) if tuple(expand_r) != rhs_shape else None,
    )
    return _Plan(dims, tuple(produced.index(c) for c in out), squeeze, expand)


def get_how_to_quantize(
    *, einsum_str: str, ndims: tuple[int, int], **how: Any
) -> qarray.HowToQuantize:
    """As dot_general.get_how_to_quantize, for the dot_general this einsum lowers to.

    Args:
      einsum_str: the two-operand einsum ("bij,bjk->bik", "...ab,...bc->...ac").
      ndims: the ranks of its operands (they size the ellipsis).
      **how: for_lhs, qtype, tile_size and calibration_method, as dot_general takes them.
    """
    # Sizes are unknown here: plan as if no axis broadcasts (a broadcast axis is a batch axis,
    # channelwise either way).
    dimension_numbers = _plan(einsum_str, (2,) * ndims[0], (2,) * ndims[1]).dimension_numbers
    return dot_general_lib.get_how_to_quantize(
        dimension_numbers=dimension_numbers, ndims=ndims, **how
    )


def lowering(einsum_str: str, lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...]) -> _Plan:
    """The dot_general a two-operand einsum lowers to (its dimension numbers, the broadcast
    axes squeezed / repeated before it, the output's permutation), for ops that run the
    dot_general their own way (QT)."""
    return _plan(einsum_str, tuple(lhs_shape), tuple(rhs_shape))


def _squeeze(x: jax.Array | qarray.QArray, axes: tuple[int, ...]) -> Any:
    if not axes:
        return x
    shape = tuple(n for i, n in enumerate(x.shape) if i not in axes)
    return x.reshape(shape)


def einsum(
    einsum_str: str,
    lhs: jax.Array | qarray.QArray,
    rhs: jax.Array | qarray.QArray,
    *,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """Two-operand einsum accepting QArrays (ellipsis and size-1 broadcasting allowed; no
    within-operand sums)."""
    plan = _plan(einsum_str, tuple(lhs.shape), tuple(rhs.shape))
    if plan.expand[0] is not None:
        lhs = qarray.broadcast_to(lhs, plan.expand[0])
    if plan.expand[1] is not None:
        rhs = qarray.broadcast_to(rhs, plan.expand[1])
    out = dot_general_lib.dot_general(
        _squeeze(lhs, plan.squeeze[0]),
        _squeeze(rhs, plan.squeeze[1]),
        plan.dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
    return jnp.transpose(out, plan.permutation)
