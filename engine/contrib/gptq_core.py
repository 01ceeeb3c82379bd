"""GPTQ (Frantar et al., 2022, arXiv:2210.17323): quantize a weight column by column, pushing
each column's rounding error onto the columns not yet quantized, weighted by the inverse Hessian
of the layer's output error, so that ||W·X − Ŵ·X||² rather than ||W − Ŵ||² is minimized.

Lingo (the reference's names, which follow the paper's PyTorch code):
  W        (rows, columns): output rows × input (contracted) columns, as in y = W · x.
  H        (columns, columns) = X · Xᵀ over calibration inputs X (columns, samples).
  Hinv     upper Cholesky factor of H⁻¹ after damping; row i holds how column i's error moves
           the later columns.
  group    `groupsize` consecutive columns sharing a scale (HowToQuantize.tiled_axes[1]; all
           columns when absent). A group's scale is computed from W as it stands when the
           algorithm reaches the block holding the group's first column (the updates made
           inside that block are not seen, as in the reference).
  block    `blocksize` columns updated together before the rest of W is corrected (the same
           maths for any block size, summed in another order).

Formulas and the one deliberate difference are in docs/calibrated-methods.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from qmill.engine.contrib import calibration
from qmill.engine.core import qarray, qtypes

normalize_weight = calibration.normalize_weight


def compute_hessian(x: jax.Array) -> jax.Array:
    """H = X · Xᵀ for inputs X of shape (in_features, samples) (the constant 2 dropped)."""
    return x @ x.T


def cholesky_inverse(lower: jax.Array) -> jax.Array:
    """(L·Lᵀ)⁻¹ from the lower Cholesky factor L."""
    return jax.scipy.linalg.cho_solve((lower, True), jnp.eye(lower.shape[0], dtype=lower.dtype))


def find_params(w: jax.Array, how: qarray.HowToQuantize) -> tuple[jax.Array, jax.Array | None]:
    """(scale, zero_point) of one group w (rows, groupsize): shaped (rows, 1) or (1, 1)."""
    group_how = qarray.HowToQuantize(
        qtype=how.qtype,
        channelwise_axes=(0,) if 0 in how.channelwise_axes else (),
        calibration_method=how.calibration_method,
    )
    return qarray.compute_scale_zero_point(qarray.calibrate(w, group_how), how.qtype)


def quantize(
    w: jax.Array, qtype: jax.typing.DTypeLike, scale: jax.Array, zero_point: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """(codes, dequantized values) of w with the given scale and zero point."""
    q = qarray.quantize_with_scale_zero_point(w, qtype, scale, zero_point)
    return q.qvalue, qarray.dequantize(q)


def _groupsize(how: qarray.HowToQuantize, columns: int) -> int:
    tile = how.tiled_axes_dict.get(1, columns)
    tile = round(columns * tile) if isinstance(tile, float) else int(tile)
    if tile <= 0 or columns % tile:
        raise ValueError(f"group size {tile} must divide the {columns} columns")
    return tile


def _inverse_hessian_factor(h: jax.Array, percdamp: float) -> tuple[jax.Array, jax.Array]:
    """(upper Cholesky factor of (H + damping)⁻¹, mask of dead columns: never seen input)."""
    columns = h.shape[0]
    diag = jnp.diag(h)
    dead = diag == 0
    h = jnp.where(dead & jnp.eye(columns, dtype=bool), 1.0, h)
    index = jnp.arange(columns)
    h = h.at[index, index].add(percdamp * jnp.mean(diag))
    inverse = cholesky_inverse(jnp.linalg.cholesky(h))
    return jnp.linalg.cholesky(inverse, upper=True), dead


def _quantize_block(w1, hinv1, scales, zero_points, qtype):
    """Column-by-column quantization of one block with error feedback inside it."""
    rows, count = w1.shape

    def step(i, carry):
        w1, err1, losses1, codes1 = carry
        w = w1[:, i]
        d = hinv1[i, i]
        zp = None if zero_points is None else zero_points[:, i][:, None]
        q, dq = quantize(w[:, None], qtype, scales[:, i][:, None], zp)
        dq = dq[:, 0]
        err = (w - dq) / d
        w1 = w1 - jnp.outer(err, hinv1[i])  # Hinv is upper triangular: only columns >= i move
        err1 = err1.at[:, i].set(err)
        losses1 = losses1.at[:, i].set((w - dq) ** 2 / d**2)
        codes1 = codes1.at[:, i].set(q[:, 0].astype(jnp.float32))
        return w1, err1, losses1, codes1

    zeros = jnp.zeros((rows, count), jnp.float32)
    return jax.lax.fori_loop(0, count, step, (w1, zeros, zeros, zeros))


def _block_scales(w, start, stop, groupsize, how, dtype, scales, zps) -> None:
    """Appends the (scale, zp) of every group whose first column lies in [start, stop).

    The scale is found in the weight's dtype so that the stored scale is the one the codes used.
    """
    rows = w.shape[0]
    for g0 in range(start, stop):
        if g0 % groupsize == 0:
            s, zp = find_params(w[:, g0 : g0 + groupsize].astype(dtype), how)
            scales.append(jnp.broadcast_to(s.astype(jnp.float32), (rows, 1)))
            zps.append(None if zp is None else jnp.broadcast_to(zp, (rows, 1)))


def quantize_weight(
    W: jax.Array,
    H: jax.Array,
    how: qarray.HowToQuantize,
    blocksize: int = 128,
    percdamp: float = 0.01,
) -> tuple[qarray.QArray, jax.Array]:
    """GPTQ-quantizes W (rows, columns) for inputs whose Hessian is H (columns, columns).

    Always compiled as one function (how, blocksize and percdamp static), called eagerly or under
    an outer jit alike: XLA fuses the column updates of a compiled run differently from op-by-op
    dispatch (an ulp in later group scales), and one compiled form gives one answer everywhere,
    the reference's own under jax.jit.

    Returns:
      (the QArray: codes (rows, columns), scale (rows | 1, columns / groupsize); the per-element
      losses (w − ŵ)² / (2 Hinv_ii²), whose sum estimates the output error added).

    Raises:
      ValueError: shapes that don't match, or a group size not dividing the columns.
    """
    columns = W.shape[1]
    if H.shape != (columns, columns):
        raise ValueError(f"Hessian shape {H.shape} must be ({columns}, {columns}) for W {W.shape}")
    _groupsize(how, columns)  # refused here, outside the trace
    return _quantize_weight(W, H, how=how, blocksize=blocksize, percdamp=percdamp)


@functools.partial(jax.jit, static_argnames=("how", "blocksize", "percdamp"))
def _quantize_weight(W, H, *, how, blocksize, percdamp):
    columns = W.shape[1]
    groupsize = _groupsize(how, columns)
    dtype = W.dtype
    # f32 throughout (the reference keeps W's dtype: identical for f32 weights, see the notes).
    w = W.astype(jnp.float32)
    hinv, dead = _inverse_hessian_factor(H.astype(jnp.float32), percdamp)
    w = jnp.where(dead[None, :], 0.0, w)
    group_scales: list[jax.Array] = []
    group_zps: list[jax.Array | None] = []
    codes, losses = [], []
    for start in range(0, columns, blocksize):
        stop = min(start + blocksize, columns)
        _block_scales(w, start, stop, groupsize, how, dtype, group_scales, group_zps)
        groups = [c // groupsize for c in range(start, stop)]
        scales = jnp.concatenate([group_scales[g] for g in groups], axis=1)
        zps = None
        if group_zps[0] is not None:
            zps = jnp.concatenate([group_zps[g] for g in groups], axis=1)
        w1, err1, losses1, codes1 = _quantize_block(
            w[:, start:stop], hinv[start:stop, start:stop], scales, zps, how.qtype
        )
        w = w.at[:, start:stop].set(w1)
        w = w.at[:, stop:].add(-(err1 @ hinv[start:stop, stop:]))
        codes.append(codes1)
        losses.append(losses1 / 2)
    scale = jnp.concatenate(group_scales, axis=1)
    zero_point = None if group_zps[0] is None else jnp.concatenate(group_zps, axis=1)
    if 0 not in how.channelwise_axes:
        scale = scale[:1]
        zero_point = None if zero_point is None else zero_point[:1]
    storage = qtypes.get(how.qtype).storage
    qvalue = jnp.concatenate(codes, axis=1).astype(storage)
    q = qarray.QArray(qvalue, scale.astype(dtype), zero_point, how.qtype)
    return q, jnp.concatenate(losses, axis=1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GptqOptions:
    """GPTQ as the field runs it on language models (llm-compressor's GPTQModifier defaults).

    Unlike `quantize_weight` (the reference's: a group's scale found when the algorithm reaches
    it), every group's scale is fixed first from the weight as it is ("static" groups), so the
    columns may be visited in any order and the stored scales are the float weight's.
    """

    # Columns updated together before the rest of W is corrected (same maths, another order).
    blocksize: int = 128
    # Fraction of mean(diag H) added to H's diagonal before inverting it.
    percdamp: float = 0.01
    # Visit columns by descending diag(H) (most-used inputs first, their error pushed onto the
    # rarely-used ones): the paper's "act-order", llm-compressor's default "static" ordering.
    actorder: bool = True

    def __post_init__(self) -> None:
        if self.blocksize <= 0:
            raise ValueError(f"GPTQ block size must be positive, got {self.blocksize}")
        if not 0 < self.percdamp < 1:
            raise ValueError(f"GPTQ dampening must lie in (0, 1), got {self.percdamp}")


def quantize_weight_static(
    W: jax.Array, H: jax.Array, how: qarray.HowToQuantize, options: GptqOptions
) -> tuple[qarray.QArray, jax.Array]:
    """GPTQ with static group scales (see GptqOptions); otherwise as `quantize_weight`.

    Returns:
      (the QArray: codes (rows, columns), scale (rows | 1, columns / groupsize); the
      per-element losses (w − ŵ)² / (2 Hinv_ii²) in the weight's column order).

    Raises:
      ValueError: shapes that don't match, or a group size not dividing the columns.
    """
    columns = W.shape[1]
    if H.shape != (columns, columns):
        raise ValueError(f"Hessian shape {H.shape} must be ({columns}, {columns}) for W {W.shape}")
    _groupsize(how, columns)
    return _quantize_weight_static(W, H, how=how, options=options)


def _static_scales(w, groupsize, how, dtype):
    """Every group's (scale, zero point), (rows, groups), from the weight as it is."""
    rows, columns = w.shape
    groups = w.astype(dtype).reshape(rows, columns // groupsize, groupsize).transpose(1, 0, 2)
    scale, zp = jax.vmap(lambda g: find_params(g, how))(groups)
    scale = jnp.broadcast_to(scale[:, :, 0].T.astype(jnp.float32), (rows, columns // groupsize))
    if zp is not None:
        zp = jnp.broadcast_to(zp[:, :, 0].T, (rows, columns // groupsize))
    return scale, zp


@functools.partial(jax.jit, static_argnames=("how", "options"))
def _quantize_weight_static(W, H, *, how, options):
    columns = W.shape[1]
    groupsize = _groupsize(how, columns)
    dtype = W.dtype
    w = W.astype(jnp.float32)
    scale, zero_point = _static_scales(w, groupsize, how, dtype)
    # A stable sort: equal diagonals keep their order, one answer everywhere.
    perm = jnp.argsort(-jnp.diag(H), stable=True) if options.actorder else jnp.arange(columns)
    group_of_column = perm // groupsize
    column_scale = scale[:, group_of_column]
    column_zp = None if zero_point is None else zero_point[:, group_of_column]
    h = H.astype(jnp.float32)[perm][:, perm]
    hinv, dead = _inverse_hessian_factor(h, options.percdamp)
    w = jnp.where(dead[None, :], 0.0, w[:, perm])
    codes, losses = [], []
    for start in range(0, columns, options.blocksize):
        stop = min(start + options.blocksize, columns)
        zps = None if column_zp is None else column_zp[:, start:stop]
        _, err1, losses1, codes1 = _quantize_block(
            w[:, start:stop],
            hinv[start:stop, start:stop],
            column_scale[:, start:stop],
            zps,
            how.qtype,
        )
        w = w.at[:, stop:].add(-(err1 @ hinv[start:stop, stop:]))
        codes.append(codes1)
        losses.append(losses1 / 2)
    inverse = jnp.argsort(perm)
    storage = qtypes.get(how.qtype).storage
    qvalue = jnp.concatenate(codes, axis=1)[:, inverse].astype(storage)
    if 0 not in how.channelwise_axes:
        scale = scale[:1]
        zero_point = None if zero_point is None else zero_point[:1]
    q = qarray.QArray(qvalue, scale.astype(dtype), zero_point, how.qtype)
    return q, jnp.concatenate(losses, axis=1)[:, inverse]
