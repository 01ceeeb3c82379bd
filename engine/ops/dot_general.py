"""Quantized dot_general: QArrays or arrays on either side.

Lingo:
  lhs, rhs     the two operands, as in jax.lax.dot_general.
  contracting  axes summed over; batch axes are paired and kept; the rest are free (channel) axes.
  native path  both operands are QArrays of uniform qtypes (integers, fp8) without zero points:
               the stored values are multiplied (int8 × int8 → int32, fp8 → f32) and both scales
               applied to the output. That is exact maths only when each scale is constant along
               what is summed, so a contracting axis with sub-channel scales is split into
               (blocks, tile): tiles are contracted natively, blocks become batch axes, are scaled,
               then summed.
  fallback     anything else (nf4, zero points, a float operand) is dequantized first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.core import qarray, qarray_util, qtypes, tiling

DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


def get_how_to_quantize(
    *,
    dimension_numbers: DimensionNumbers,
    ndims: tuple[int, int],
    for_lhs: bool,
    qtype: Any,
    tile_size: int | float | Mapping[int, int | float] | None = None,
    calibration_method: str = "absmax",
) -> qarray.HowToQuantize:
    """How to quantize one operand: channelwise on its non-contracting axes, and the (last)
    contracting axis tiled by `tile_size` when given (sub-channel quantization). A mapping
    {axis: tile} (also as an AxisTiles) tiles exactly those axes, which then are not channelwise."""
    (lhs_c, rhs_c), _ = dimension_numbers
    ndim = ndims[0] if for_lhs else ndims[1]
    contracting = tuple(a % ndim for a in (lhs_c if for_lhs else rhs_c))
    if isinstance(tile_size, Mapping | qarray_util.AxisTiles):
        tiled = dict(tile_size.items())
    else:
        # mx / nv formats come with their block size: without a tile_size they are tiled by it
        # (the reference infers it too), along the axis the dot sums, where a block's scale can
        # be applied after the product.
        tile_size = tile_size or qtypes.get(qtype).required_tile
        tiled = {contracting[-1]: tile_size} if tile_size and contracting else {}
    channelwise = tuple(a for a in range(ndim) if a not in contracting and a not in tiled)
    return qarray.HowToQuantize(
        qtype=qtype,
        channelwise_axes=channelwise,
        tiled_axes=tiled,
        calibration_method=calibration_method,
    )


def _as_array(x: Any) -> jax.Array:
    return qarray.dequantize(x) if isinstance(x, qarray.QArray) else jnp.asarray(x)


def plain_operands(
    lhs: Any, rhs: Any, preferred_element_type: Any, *, same_dtype: bool = False
) -> tuple[Any, Any, Any]:
    """(lhs, rhs, preferred_element_type) for the jax.lax op on dequantized / plain operands.

    As the reference: integers × integers accumulate in int32 unless told otherwise (jax.lax
    would return int8, overflowing). `same_dtype` (conv: jax.lax refuses mixed
    dtypes there) promotes mixed operands, e.g. an int8 array × float32, to their common type;
    dot_general takes mixed dtypes itself, and leaving them to it keeps its numerics.
    """
    a, b = _as_array(lhs), _as_array(rhs)
    integers = jnp.issubdtype(a.dtype, jnp.integer) and jnp.issubdtype(b.dtype, jnp.integer)
    if preferred_element_type is None and integers:
        preferred_element_type = jnp.int32
    if same_dtype and a.dtype != b.dtype:
        common = jnp.result_type(a.dtype, b.dtype)
        a, b = a.astype(common), b.astype(common)
    return a, b, preferred_element_type


def _native_pair(lhs: Any, rhs: Any) -> bool:
    if not (isinstance(lhs, qarray.QArray) and isinstance(rhs, qarray.QArray)):
        return False
    ql, qr = qtypes.get(lhs.qtype), qtypes.get(rhs.qtype)
    return (
        ql.native_matmul
        and qr.native_matmul
        and ql.kind == qr.kind
        and lhs.zero_point is None
        and rhs.zero_point is None
    )


def _split_contracting(lhs: qarray.QArray, rhs: qarray.QArray, dims: DimensionNumbers):
    """Splits contracting axes whose scales vary along them; returns the new operands/dims.

    Returns (lhs_q, lhs_s, rhs_q, rhs_s, dimension_numbers, n_blocks) or None when the two
    operands' tiles along a contracting pair are incompatible (neither divides the other).
    """
    (lc, rc), (lb, rb) = dims
    lq, ls, rq, rs = lhs.qvalue, lhs.scale, rhs.qvalue, rhs.scale
    ltiles, rtiles = lhs.scale_tile_shape, rhs.scale_tile_shape
    new_lc, new_rc, block_l, block_r = [], [], [], []
    # Process pairs from the highest axis down so earlier axis numbers stay valid.
    pairs = sorted(zip(lc, rc, strict=True), key=lambda p: -p[0])
    splits: list[tuple[int, int, int]] = []
    for a_l, a_r in pairs:
        size, tl, tr = lq.shape[a_l], ltiles[a_l], rtiles[a_r]
        t = math.gcd(tl, tr)
        if t == size:
            continue
        if tl % t or tr % t:
            return None
        splits.append((a_l, a_r, t))
    lsplit = {a_l: t for a_l, _, t in splits}
    rsplit = {a_r: t for _, a_r, t in splits}

    def split(q: jax.Array, s: jax.Array, where: dict[int, int]):
        qshape, sshape = [], []
        for axis, size in enumerate(q.shape):
            if axis in where:
                t = where[axis]
                reps = (size // t) // s.shape[axis]
                s = jnp.repeat(s, reps, axis=axis) if reps > 1 else s
                qshape += [size // t, t]
                sshape += [s.shape[axis], 1]
            else:
                qshape.append(size)
                sshape.append(s.shape[axis])
        return q.reshape(qshape), s.reshape(sshape)

    def new_axis(axis: int, where: dict[int, int]) -> int:
        return axis + sum(1 for a in where if a < axis)

    lq2, ls2 = split(lq, ls, lsplit)
    rq2, rs2 = split(rq, rs, rsplit)
    for a_l, a_r in zip(lc, rc, strict=True):
        if a_l in lsplit:
            block_l.append(new_axis(a_l, lsplit))
            block_r.append(new_axis(a_r, rsplit))
            new_lc.append(new_axis(a_l, lsplit) + 1)
            new_rc.append(new_axis(a_r, rsplit) + 1)
        else:
            new_lc.append(new_axis(a_l, lsplit))
            new_rc.append(new_axis(a_r, rsplit))
    new_lb = [new_axis(a, lsplit) for a in lb] + block_l
    new_rb = [new_axis(a, rsplit) for a in rb] + block_r
    new_dims = ((tuple(new_lc), tuple(new_rc)), (tuple(new_lb), tuple(new_rb)))
    return lq2, ls2, rq2, rs2, new_dims, len(block_l)


def _scale_to_output(
    s: jax.Array, q_shape: tuple[int, ...], batch, contracting, n_other: int, lhs: bool
):
    """Lays a scale out along the dot_general output: (batch..., lhs free..., rhs free...)."""
    free = [a for a in range(len(q_shape)) if a not in batch and a not in contracting]
    full = tiling.broadcast_to(
        s, tuple(q_shape[a] if s.shape[a] != 1 else 1 for a in range(len(q_shape)))
    )
    full = jnp.squeeze(full, axis=tuple(contracting)) if contracting else full
    # After squeezing, axes keep their relative order; map original axis -> squeezed index.
    kept = [a for a in range(len(q_shape)) if a not in contracting]
    order = [kept.index(a) for a in batch] + [kept.index(a) for a in free]
    full = jnp.transpose(full, order)
    nb = len(batch)
    shape = list(full.shape)
    # lhs scales go before the rhs free axes, rhs scales after the lhs free axes.
    shape = shape + [1] * n_other if lhs else shape[:nb] + [1] * n_other + shape[nb:]
    return full.reshape(shape)


def native_codes(
    lhs: qarray.QArray, rhs: qarray.QArray, lq: jax.Array, rq: jax.Array
) -> tuple[jax.Array, jax.Array, Any]:
    """(lq, rq, accumulator dtype) for a native matmul of the codes lq / rq of lhs / rhs (a
    `_native_pair`): integers as int8 into int32 (int32 past 8 bits), floats into float32 (mixed
    float codes as bfloat16)."""
    if qtypes.get(lhs.qtype).kind == qtypes.INT:
        lq, rq, acc = lq.astype(jnp.int8), rq.astype(jnp.int8), jnp.int32
        if qtypes.get(lhs.qtype).bits > 8 or qtypes.get(rhs.qtype).bits > 8:
            lq, rq = lq.astype(jnp.int32), rq.astype(jnp.int32)
        return lq, rq, acc
    if lq.dtype != rq.dtype:
        lq, rq = lq.astype(jnp.bfloat16), rq.astype(jnp.bfloat16)
    return lq, rq, jnp.float32


def _native(
    lhs: qarray.QArray,
    rhs: qarray.QArray,
    dims,
    preferred_element_type,
    precision,
    in_result_dtype: bool = False,
):
    split = _split_contracting(lhs, rhs, dims)
    if split is None:
        return None
    lq, ls, rq, rs, dims2, n_blocks = split
    lq, rq, acc = native_codes(lhs, rhs, lq, rq)
    result_dtype = preferred_element_type or jnp.result_type(lhs.scale.dtype, rhs.scale.dtype)
    if in_result_dtype and not jnp.issubdtype(acc, jnp.integer):
        acc = result_dtype
    out = jax.lax.dot_general(lq, rq, dims2, precision=precision, preferred_element_type=acc)
    split = (lq, ls, rq, rs, dims2, n_blocks)
    return scale_split_product(out, split, result_dtype, in_result_dtype)


def scale_split_product(
    out: jax.Array, split: Any, result_dtype: Any, in_result_dtype: bool = False
) -> jax.Array:
    """The codes' product `out` over a `_split_contracting` split, times both scales, its
    contraction blocks summed, as `result_dtype`. The scales are applied in float32 (one
    rounding), or with `in_result_dtype` one factor at a time in the promoted dtype (the
    reference's QT arithmetic: bfloat16 scales round after each factor)."""
    lq, ls, rq, rs, dims2, n_blocks = split
    (lc, rc), (lb, rb) = dims2
    n_lfree = lq.ndim - len(lb) - len(lc)
    n_rfree = rq.ndim - len(rb) - len(rc)
    s_l = _scale_to_output(ls, lq.shape, lb, lc, n_rfree, lhs=True)
    s_r = _scale_to_output(rs, rq.shape, rb, rc, n_lfree, lhs=False)
    if in_result_dtype:
        out = out * s_l * s_r
    else:
        out = out.astype(jnp.float32) * s_l.astype(jnp.float32) * s_r.astype(jnp.float32)
    if n_blocks:
        n_batch = len(lb) - n_blocks
        out = jnp.sum(out, axis=tuple(range(n_batch, n_batch + n_blocks)))
    return out.astype(result_dtype)


def dot_general(
    lhs: jax.Array | qarray.QArray,
    rhs: jax.Array | qarray.QArray,
    dimension_numbers: DimensionNumbers,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    scales_in_result_dtype: bool = False,
    **kwargs: Any,
) -> jax.Array:
    """jax.lax.dot_general accepting QArrays; see the module docstring for the paths taken.

    ``scales_in_result_dtype``: on the native path, a float product accumulates in the result
    dtype and the scales multiply the output in it one at a time (see scale_split_product);
    qmill's QT uses it for the reference's numbers."""
    if kwargs.get("out_sharding") is None:
        kwargs.pop("out_sharding", None)
    dims = _normalize(dimension_numbers, _ndim(lhs), _ndim(rhs))
    if _native_pair(lhs, rhs):
        out = _native(lhs, rhs, dims, preferred_element_type, precision, scales_in_result_dtype)
        if out is not None:
            return out
    a, b, preferred_element_type = plain_operands(lhs, rhs, preferred_element_type)
    return jax.lax.dot_general(
        a, b, dims, precision=precision, preferred_element_type=preferred_element_type, **kwargs
    )


def _ndim(x: Any) -> int:
    return len(x.shape)


def _normalize(dims: DimensionNumbers, lhs_ndim: int, rhs_ndim: int) -> DimensionNumbers:
    (lc, rc), (lb, rb) = dims
    norm = lambda axes, n: tuple(int(a) % n for a in np.atleast_1d(axes))  # noqa: E731
    return (norm(lc, lhs_ndim), norm(rc, rhs_ndim)), (norm(lb, lhs_ndim), norm(rb, rhs_ndim))
