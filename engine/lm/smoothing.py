"""A decoder layer smoothed (AWQ or SmoothQuant, folded: folds.py), then quantized by round to
nearest or GPTQ: the layer-by-layer calibration of `--method awq|awq+gptq|smoothquant|
smoothquant+gptq`.

Lingo (sequential.py for hidden and stage, folds.py for fold and s).

The scheme, per layer, as llm-compressor applies its smoothing modifiers before quantizing: the
layer's folds in forward order, each on the float layer as smoothed so far: run the stages up to
the fold's, take its linears' input x, find s (AWQ: awq.search; SmoothQuant: the formula below),
fold it. Then the smoothed layer is quantized as `--method gptq` quantizes it
(sequential.calibrate_layer, its Hessians on the smoothed inputs), whose quantized output is the
next layer's input (GPTQ fits each linear to the error before it), or linear by linear by round
to nearest (AWQ's weights clipped first: awq_clip.py), where the next layer's input is the float
layer's output (rtn_layer).

SmoothQuant (Xiao et al., arXiv:2211.10438) with llm-compressor's statistics: r_j = max − min of
input channel j over every calibration token, w_j = 2 · max over the balanced weights of
|W[:, j]|, s_j = r_j^α / w_j^(1−α) (r_j where w_j = 0), at least 1e-5; α the migration strength.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.contrib import gptq_core
from qmill.engine.core import qarray_parts
from qmill.engine.lm import awq as awq_lib
from qmill.engine.lm import awq_clip, forward, sequential
from qmill.engine.lm import config as config_lib
from qmill.engine.lm import folds as folds_lib
from qmill.engine.modelfree import layout
from qmill.engine.modelfree import leaf as leaf_lib

_F32 = jnp.float32
# The smallest SmoothQuant scale (llm-compressor's MINIMUM_SMOOTHING_SCALE).
_SQ_MIN = 1e-5


@dataclasses.dataclass(frozen=True, kw_only=True)
class SmoothingOptions:
    """How the layer is smoothed."""

    # "awq" or "smoothquant" (folds.METHODS).
    method: str
    # AWQ's grid.
    awq: awq_lib.AwqOptions = dataclasses.field(default_factory=awq_lib.AwqOptions)
    # SmoothQuant's migration strength α in [0, 1] (llm-compressor's smoothing_strength).
    alpha: float = 0.5

    def __post_init__(self) -> None:
        if self.method not in folds_lib.METHODS:
            raise ValueError(f"smoothing method {self.method!r} is not one of {folds_lib.METHODS}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"the SmoothQuant strength must be in [0, 1], got {self.alpha}")


def smoothquant_scale(
    fold: folds_lib.Fold,
    weights: Mapping[str, jax.Array],
    xs: Sequence[jax.Array],
    alpha: float,
) -> tuple[jax.Array, dict[str, Any]]:
    """SmoothQuant's s for `fold` from its input chunks xs (module docstring)."""
    low, high = _min_max(xs[0])
    for x in xs[1:]:
        low, high = _min_max(x, low, high)
    w = None
    for name in fold.balance:
        w = _column_absmax(jnp.asarray(weights[name]), w)
    s = _sq_scale(high - low, w, alpha)
    return s, {"alpha": alpha, "scale_min": float(s.min()), "scale_max": float(s.max())}


@jax.jit
def _min_max(x: jax.Array, low: jax.Array | None = None, high: jax.Array | None = None):
    """Per channel: the min and max of x over its tokens, and of the running ones."""
    x = x.reshape(-1, x.shape[-1]).astype(_F32)
    lo, hi = x.min(axis=0), x.max(axis=0)
    if low is None:
        return lo, hi
    return jnp.minimum(low, lo), jnp.maximum(high, hi)


@jax.jit
def _column_absmax(w: jax.Array, running: jax.Array | None = None) -> jax.Array:
    m = jnp.abs(w.astype(_F32)).max(axis=0)
    return m if running is None else jnp.maximum(running, m)


@jax.jit
def _sq_scale(spread: jax.Array, w_max: jax.Array, alpha: float) -> jax.Array:
    w = 2.0 * w_max
    s = jnp.where(w > 0, spread**alpha / w ** (1 - alpha), spread)
    return jnp.maximum(s, _SQ_MIN)


def _stage(cfg, layer: int, index: int, weights, carry) -> dict[str, jax.Array]:
    return forward.stage_fn(cfg, layer, index)(weights, carry)


def smooth_layer(
    cfg: config_lib.LmConfig,
    layer: int,
    weights: Mapping[str, np.ndarray | jax.Array],
    hidden: sequential.Hidden,
    plans: Mapping[str, layout.LeafPlan],
    options: SmoothingOptions,
) -> tuple[dict[str, jax.Array], list[folds_lib.Fold], list[dict[str, Any]]]:
    """The layer's weights with every fold of the method applied (module docstring), the folds
    applied, and one report entry per fold. A fold none of whose linears `plans` quantizes is
    left out (nothing to protect)."""
    current = {name: jnp.asarray(w) for name, w in weights.items()}
    quantized = frozenset(plans)
    carries = [{"h": h} for h in hidden]
    at, applied, report = 0, [], []
    for fold in folds_lib.table(cfg, options.method, layer):
        if not any(n in plans for n in fold.balance):
            continue
        while at < fold.stage:  # the carries entering the fold's stage
            carries = [_stage(cfg, layer, at, current, c) for c in carries]
            at += 1
        xs = [_stage(cfg, layer, at, current, c)["x"] for c in carries]
        if options.method == folds_lib.AWQ:
            s, info = awq_lib.search(cfg, layer, fold, current, xs, plans, options.awq)
        else:
            s, info = smoothquant_scale(fold, current, xs, options.alpha)
        current.update(folds_lib.apply(current, fold, s, keep_float32=quantized))
        applied.append(fold)
        report.append({"fold": fold.name, **info})
        del xs
    return current, applied, report


def rtn_layer(
    cfg: config_lib.LmConfig,
    layer: int,
    weights: Mapping[str, jax.Array],
    hidden: sequential.Hidden,
    plans: Mapping[str, layout.LeafPlan],
    float_weights: Mapping[str, jax.Array] | None = None,
) -> sequential.LayerCalibration:
    """Every linear of `plans` rounded to nearest, exactly as the checkpoint pipeline writes it,
    and the next layer's input: the float (smoothed) layer run on the hidden states, whose
    weights are `float_weights` where given (`weights` clipped by AWQ: not the float model)."""
    prefix = config_lib.layer_prefix(cfg, layer)
    current = dict(weights)
    results: dict[str, leaf_lib.LeafResult] = {}
    for name, plan in plans.items():
        result = leaf_lib.quantize_leaf(np.asarray(current[name]), plan)
        zero_point = None if result.zero_point is None else jnp.asarray(result.zero_point)
        current[name] = _dequantize(
            jnp.asarray(result.codes()), plan.qtype, jnp.asarray(result.scale), zero_point
        )
        results[prefix + name] = result
    # The float layer's output, not the rounded one's: nothing here is fitted to the rounding,
    # so the later layers' scales are searched on the float model's activations, as
    # llm-compressor's pipeline (quantization disabled until the end) and AutoAWQ have them
    # (measured: docs/calibrated-methods.md, "The calibration inputs").
    float_layer = weights if float_weights is None else float_weights
    float_output = sequential.run_layer(cfg, layer, float_layer, hidden)
    return sequential.LayerCalibration(results, {}, current, float_output)


@functools.partial(jax.jit, static_argnums=1)
def _dequantize(codes, qtype: str, scale, zero_point) -> jax.Array:
    """codes × scale (− zero point) in the scale's dtype, as the checkpoint holds them."""
    return qarray_parts.dequantize_bytes(codes, qtype, scale, zero_point).astype(_F32)


def calibrate_layer(
    cfg: config_lib.LmConfig,
    layer: int,
    weights: Mapping[str, np.ndarray | jax.Array],
    hidden: sequential.Hidden,
    plans: Mapping[str, layout.LeafPlan],
    options: SmoothingOptions,
    gptq: gptq_core.GptqOptions | None,
    *,
    all_experts: bool = False,
) -> sequential.LayerCalibration:
    """Smooths decoder layer `layer` and quantizes it: GPTQ with `gptq` (`all_experts` as
    sequential.calibrate_layer takes it), else round to nearest.

    The result's `folded` holds the float tensors the folds changed that are not quantized (the
    norms, biases; full names, their own dtype), written in place of the source's; `methods`
    names each quantized linear's method ("awq+gptq" for a balanced one, "gptq" for one no fold
    scaled, ...); `smoothing` the folds' report, then AWQ's clipping's, one entry per linear
    clipped ({"clip": its name, ...}: awq_clip.clip_layer).

    Raises:
      ValueError: a plan the method cannot follow (an NVFP4 global scale), or no finite AWQ error.
    """
    plans = scales_in_source_dtype(plans, weights)
    smoothed, applied, report = smooth_layer(cfg, layer, weights, hidden, plans, options)
    if gptq is not None:
        done = sequential.calibrate_layer(
            cfg, layer, smoothed, hidden, plans, gptq, all_experts=all_experts
        )
    else:
        rounded = smoothed
        if options.method == folds_lib.AWQ and options.awq.clip:
            rounded, clips = awq_clip.clip_layer(cfg, layer, smoothed, hidden, plans)
            report += [{"clip": name, **info} for name, info in clips.items()]
        done = rtn_layer(cfg, layer, rounded, hidden, plans, float_weights=smoothed)
    prefix = config_lib.layer_prefix(cfg, layer)
    changed = {n for fold in applied for n in _changed(fold)}
    balanced = {n for fold in applied for n in fold.balance}
    suffix = "+gptq" if gptq is not None else ""
    base = "gptq" if gptq is not None else "rtn"
    return dataclasses.replace(
        done,
        folded={prefix + n: np.asarray(smoothed[n]) for n in sorted(changed - set(plans))},
        methods={prefix + n: options.method + suffix if n in balanced else base for n in plans},
        smoothing=report,
    )


def scales_in_source_dtype(
    plans: Mapping[str, layout.LeafPlan], weights: Mapping[str, Any]
) -> dict[str, layout.LeafPlan]:
    """The plans with each scale stored in its weight's dtype as read, where the recipe leaves
    it to the weight's: the folds keep the linears they scale in float32 (folds.apply), and a
    bf16 checkpoint's scales stay bf16 (compressed-tensors' layout for it)."""
    return {
        name: plan
        if plan.scale_dtype is not None
        else dataclasses.replace(plan, scale_dtype=np.dtype(weights[name].dtype).name)
        for name, plan in plans.items()
    }


def _changed(fold: folds_lib.Fold) -> tuple[str, ...]:
    return (*fold.balance, fold.smooth, *((fold.bias,) if fold.bias else ()))
