"""Quantizes one checkpoint tensor as a LeafPlan says, and measures how faithful the result is.

This is the service's unit of work: the server and the client's embedded mode both call
`quantize_leaf`, so their outputs are the same bits. Compiled functions are cached per (shape,
dtype, plan): a checkpoint of many same-shaped tensors compiles once per shape.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine import layout, qarray


@dataclasses.dataclass(frozen=True)
class Quality:
    # 10·log10(Σx² / Σ(x − x̂)²); +inf when the round trip is exact.
    sqnr_db: float
    # mean|x − x̂| / mean|x|; 0 when both are 0.
    mean_relative_error: float


@dataclasses.dataclass(frozen=True)
class LeafResult:
    """Host (numpy) parts of a quantized tensor, ready to be written or sent."""

    qvalue: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None
    quality: Quality


@functools.partial(jax.jit, static_argnames=("plan",))
def _quantize_and_measure(x: jax.Array, plan: layout.LeafPlan):
    q = qarray.quantize(
        x,
        qarray.HowToQuantize(
            qtype=plan.qtype,
            channelwise_axes=plan.channelwise_axes,
            tiled_axes=dict(plan.tiled_axes),
            calibration_method=plan.calibration_method,
        ),
        scale_dtype=plan.scale_dtype,
    )
    x32 = x.astype(jnp.float32)
    err = qarray.dequantize(q).astype(jnp.float32) - x32
    signal, noise = jnp.sum(x32 * x32), jnp.sum(err * err)
    abs_x, abs_err = jnp.mean(jnp.abs(x32)), jnp.mean(jnp.abs(err))
    # Fused into the same pass over x, so the check costs next to nothing.
    finite = jnp.isfinite(x32).all()
    return q, signal, noise, abs_x, abs_err, finite


def quantize_leaf(array: np.ndarray | jax.Array, plan: layout.LeafPlan) -> LeafResult:
    """Quantizes `array` as `plan` says (plan.quantize must be true).

    Raises:
      ValueError: NaN/Inf in the tensor, or a plan the engine refuses (bad qtype, tile, method).
    """
    if not plan.quantize:
        raise ValueError(f"{plan.path}: the plan keeps this tensor ({plan.reason})")
    outputs = jax.device_get(_quantize_and_measure(jnp.asarray(array), plan))
    q, signal, noise, abs_x, abs_err, finite = outputs
    if not finite:
        raise ValueError(
            f"{plan.path}: tensor contains NaN or Inf; quantization would spread them over whole "
            "scale blocks. Fix the checkpoint or skip this path with a rule"
        )
    signal, noise, abs_x, abs_err = (float(v) for v in (signal, noise, abs_x, abs_err))
    sqnr = math.inf if noise == 0 else 10 * math.log10(signal / noise) if signal else -math.inf
    mre = 0.0 if abs_err == 0 else abs_err / abs_x if abs_x else math.inf
    return LeafResult(
        qvalue=np.asarray(q.qvalue),
        scale=np.asarray(q.scale),
        zero_point=None if q.zero_point is None else np.asarray(q.zero_point),
        quality=Quality(sqnr_db=sqnr, mean_relative_error=mre),
    )
