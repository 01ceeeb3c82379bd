"""GPTQ (Frantar et al., 2022, arXiv:2210.17323): quantize a weight column by column, pushing
each column's rounding error onto the columns not yet quantized, weighted by the inverse Hessian
of the layer's output error, so that ||W·X − Ŵ·X||² rather than ||W − Ŵ||² is minimized.

Lingo:
  W        (rows, columns): output rows × input (contracted) columns, as in y = W · x.
  H        (columns, columns) = X · Xᵀ over calibration inputs X (columns, samples).
  Hinv     upper Cholesky factor of H⁻¹ after damping; row i holds how column i's error moves
           the later columns.
  group    `groupsize` consecutive columns sharing a scale (HowToQuantize.tiled_axes[1]; all
           columns when absent). A group's scale is computed from the (already error-updated)
           weights when the algorithm reaches the block holding the group's first column.
  block    `blocksize` columns updated together before the rest of W is corrected (the same
           maths for any block size, summed in another order; larger blocks trace fewer ops).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from qmill.engine.contrib import calibration
from qmill.engine.core import qarray, qtypes
from qmill.engine.modeling import rules as rules_lib

normalize_weight = calibration.normalize_weight


def compute_hessian(x: jax.Array) -> jax.Array:
    """H = X · Xᵀ for inputs X of shape (in_features, samples) (the constant 2 dropped)."""
    return x @ x.T


def _group_how(how: qarray.HowToQuantize) -> qarray.HowToQuantize:
    """How to calibrate one (rows, groupsize) slice: per row if axis 0 is channelwise."""
    return qarray.HowToQuantize(
        qtype=how.qtype,
        channelwise_axes=(0,) if 0 in how.channelwise_axes else (),
        calibration_method=how.calibration_method,
    )


def find_params(w: jax.Array, how: qarray.HowToQuantize) -> tuple[jax.Array, jax.Array | None]:
    """(scale, zero_point) of one group w (rows, groupsize): shaped (rows, 1) or (1, 1)."""
    calibration = qarray.calibrate(w, _group_how(how))
    return qarray.compute_scale_zero_point(calibration, how.qtype)


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
    h = h + jnp.eye(columns, dtype=h.dtype) * (percdamp * jnp.mean(diag))
    lower = jnp.linalg.cholesky(h)
    inverse = jax.scipy.linalg.cho_solve((lower, True), jnp.eye(columns, dtype=h.dtype))
    return jnp.linalg.cholesky(inverse, upper=True), dead


def _quantize_block(w1, hinv1, scales, zero_points, qtype):
    """Column-by-column quantization of one block with error feedback inside it."""
    rows, count = w1.shape

    def step(i, carry):
        w1, err1, losses1, codes1 = carry
        w = w1[:, i]
        d = hinv1[i, i]
        s = scales[:, i][:, None]
        zp = None if zero_points is None else zero_points[:, i][:, None]
        q = qarray.quantize_with_scale_zero_point(w[:, None], qtype, s, zp)
        dq = qarray.dequantize(q)[:, 0]
        err = (w - dq) / d
        w1 = w1 - jnp.outer(err, hinv1[i])  # Hinv is upper triangular: only columns >= i move
        err1 = err1.at[:, i].set(err)
        losses1 = losses1.at[:, i].set((w - dq) ** 2 / d**2 / 2)
        codes1 = codes1.at[:, i].set(q.qvalue[:, 0].astype(jnp.float32))
        return w1, err1, losses1, codes1

    zeros = jnp.zeros((rows, count), jnp.float32)
    return jax.lax.fori_loop(0, count, step, (w1, zeros, zeros, zeros))


def quantize_weight(
    w: jax.Array,
    h: jax.Array,
    how: qarray.HowToQuantize,
    blocksize: int = 128,
    percdamp: float = 0.01,
) -> tuple[qarray.QArray, jax.Array]:
    """GPTQ-quantizes w (rows, columns) for inputs whose Hessian is h (columns, columns).

    Returns:
      (the QArray: codes (rows, columns), scale (rows | 1, columns / groupsize); the per-element
      losses (w − ŵ)² / (2 Hinv_ii²), whose sum estimates the output error added).

    Raises:
      ValueError: shapes that don't match, or a group size not dividing the columns.
    """
    rows, columns = w.shape
    if h.shape != (columns, columns):
        raise ValueError(f"Hessian shape {h.shape} must be ({columns}, {columns}) for W {w.shape}")
    groupsize = _groupsize(how, columns)
    dtype = w.dtype
    w = w.astype(jnp.float32)
    hinv, dead = _inverse_hessian_factor(h.astype(jnp.float32), percdamp)
    w = jnp.where(dead[None, :], 0.0, w)
    group_scales: list[jax.Array] = []
    group_zps: list[jax.Array | None] = []
    codes, losses = [], []
    for start in range(0, columns, blocksize):
        stop = min(start + blocksize, columns)
        # Groups starting in this block take their scale from W as it stands now.
        for g0 in range(start, stop):
            if g0 % groupsize == 0:
                s, zp = find_params(w[:, g0 : g0 + groupsize].astype(dtype), how)
                group_scales.append(jnp.broadcast_to(s.astype(jnp.float32), (rows, 1)))
                group_zps.append(None if zp is None else jnp.broadcast_to(zp, (rows, 1)))
        col_groups = [c // groupsize for c in range(start, stop)]
        scales = jnp.concatenate([group_scales[g] for g in col_groups], axis=1)
        zps = None
        if group_zps[0] is not None:
            zps = jnp.concatenate([group_zps[g] for g in col_groups], axis=1)
        w1, err1, losses1, codes1 = _quantize_block(
            w[:, start:stop], hinv[start:stop, start:stop], scales, zps, how.qtype
        )
        w = w.at[:, start:stop].set(w1)
        w = w.at[:, stop:].add(-(err1 @ hinv[start:stop, stop:]))
        codes.append(codes1)
        losses.append(losses1)
    scale = jnp.concatenate(group_scales, axis=1)
    if 0 not in how.channelwise_axes:
        scale = scale[:1]
    zero_point = None
    if group_zps[0] is not None:
        zero_point = jnp.concatenate(group_zps, axis=1)
        zero_point = zero_point if 0 in how.channelwise_axes else zero_point[:1]
    storage = qtypes.get(how.qtype).storage
    qvalue = jnp.concatenate(codes, axis=1).astype(storage)
    return qarray.QArray(qvalue, scale.astype(dtype), zero_point, how.qtype), jnp.concatenate(
        losses, axis=1
    )


# ---- the model-level flow: calibrate (Hessians), then quantize_params --------------------------

_STATS_SUFFIX = "_gptq"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GptqRule(rules_lib.QuantizationRule):
    """A QuantizationRule whose matched weights GPTQ quantizes (PtqProvider serves them)."""


class GptqCalibrationProvider(calibration.SinglePassCalibrationProvider):
    """Runs the float model and averages each GptqRule weight's input Hessian X·Xᵀ into
    quant_stats `<weight>_gptq` (apply with mutable=["quant_stats"] for every batch)."""

    def get_rule_type(self) -> type[rules_lib.QuantizationRule]:
        return GptqRule

    def get_stats_suffix(self) -> str:
        return _STATS_SUFFIX

    def compute_stats(self, lhs: jax.Array) -> dict[str, jax.Array]:
        return {"hessian": compute_hessian(lhs.astype(jnp.float32))}


def quantize_params(
    params: Any,
    abstract_quantized_params: Any,
    gptq_quant_stats: Any,
    *,
    allow_extra_params: bool = False,
    gptq_block_size: int = 128,
    gptq_damping_factor: float = 0.01,
) -> Any:
    """ptq.quantize_params, with GPTQ for the weights that have `<weight>_gptq` statistics.

    Returns:
      The quantized params for the PTQ model (same structure as ptq.quantize_params gives).
    """

    def quantize(ctx: calibration.CalibratedQuantContext) -> Any:
        q, _ = quantize_weight(
            ctx.weight,
            ctx.calibration_stats["hessian"],
            ctx.how,
            blocksize=gptq_block_size,
            percdamp=gptq_damping_factor,
        )
        return ctx.abs_w.replace(array=ctx.restore_shape(q))

    return calibration.quantize_params_with_calibration(
        params,
        abstract_quantized_params,
        gptq_quant_stats,
        _STATS_SUFFIX,
        quantize,
        allow_extra_params=allow_extra_params,
    )
