"""AWQ's scale search for one fold of a decoder layer (Lin et al., arXiv:2306.00978), as
llm-compressor runs it: on the output of the block the balanced linears belong to.

Lingo (folds.py for fold and s):
  x        the balanced linears' common input, (B, T, in) float32 chunks of the calibration
           samples, from the layer as smoothed so far (earlier layers quantized).
  block    what the fold's linears feed, whose output error is measured: the attention with
           o_proj (q/k/v), o_proj (v → o), the MLP (gate/up), down_proj (up → down).
  x_mean   mean |x| per input channel over every calibration token.
  w_mean   per input channel, the mean over the balanced weights' rows of |W| divided by the
           absmax of its quantization group (row, group of columns or whole tensor).

For each grid point (ratio r, duo): s = x_mean^r, or with duo scaling x_mean^r / (w_mean^(1−r)
+ 1e-4); s := max(s, 1e-4) / sqrt(max s · min s), non-finite entries 1. Each quantized balanced
weight becomes Q(W · s) / s (round to nearest on the tensor's plan), the block runs on the
calibration x, and the error is the mean squared difference from the float block's output. The
s of the smallest error is kept (the first of equals). The grid's first point is s = 1: round to
nearest, whose error the report keeps beside the best one. For o_proj and down_proj, whose block
is the linear itself, the error is computed from H = Σ xᵀx as Σ_rows δW·H·δWᵀ (δW = W − Ŵ) when
the linear has fewer inputs than there are tokens: the same number, without running the
calibration tokens through each candidate.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.core import qarray_parts
from qmill.engine.lm import config as config_lib
from qmill.engine.lm import folds as folds_lib
from qmill.engine.lm import forward
from qmill.engine.modelfree import layout, leaf

_F32 = jnp.float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class AwqOptions:
    """The grid AWQ searches (llm-compressor's defaults)."""

    # Grid points: ratios evenly spaced over [0, 1].
    n_grid: int = 20
    # True: s = 1 first, then n_grid − 1 points of x_mean^r / w_mean^(1−r); False: n_grid
    # points of x_mean^r; "both": n_grid / 2 ratios, each without and with.
    duo_scaling: bool | str = True
    # Round to nearest after the scales (not GPTQ) clamps each row's groups where that lowers
    # the linear's output error (awq_clip.py), as the authors' llm-awq does; llm-compressor does
    # not.
    clip: bool = True

    def __post_init__(self) -> None:
        if self.n_grid < 2:
            raise ValueError(f"the AWQ grid takes at least 2 points, got {self.n_grid}")
        if self.duo_scaling not in (True, False, "both"):
            raise ValueError(f"duo_scaling must be True, False or 'both', not {self.duo_scaling!r}")


def grid(options: AwqOptions) -> list[tuple[float, bool]]:
    """(ratio, duo) of every grid point, in search order; the first is s = 1."""
    n = options.n_grid
    if options.duo_scaling == "both":
        half = n // 2
        return [(i / (half - 1), duo) for i in range(half) for duo in (False, True)]
    if options.duo_scaling:
        return [(0.0, False)] + [(i / (n - 2), True) for i in range(n - 1)]
    return [(i / (n - 1), False) for i in range(n)]


def activation_mean(xs: Sequence[jax.Array]) -> jax.Array:
    """mean |x| per input channel over every token of every chunk (float32)."""
    total = sum(_abs_sum(x) for x in xs)
    count = sum(int(np.prod(x.shape[:-1])) for x in xs)
    return total / count


@jax.jit
def _abs_sum(x: jax.Array) -> jax.Array:
    return jnp.sum(jnp.abs(x.reshape(-1, x.shape[-1]).astype(_F32)), axis=0)


def weight_mean(weights: Sequence[jax.Array], plans: Sequence[layout.LeafPlan]) -> jax.Array:
    """Per input column: the mean over every row of the weights of |W| / its group's absmax."""
    total = sum(
        _normed_column_sum(jnp.asarray(w), _group(p, jnp.shape(w)))
        for w, p in zip(weights, plans, strict=True)
    )
    return total / sum(jnp.shape(w)[0] for w in weights)


@functools.partial(jax.jit, static_argnames="chunk")
def _normed_column_sum(w: jax.Array, chunk: int) -> jax.Array:
    w = jnp.abs(w.astype(_F32))
    grouped = w.reshape(-1, chunk)
    normed = (grouped / (grouped.max(axis=1, keepdims=True) + 1e-6)).reshape(w.shape)
    return normed.sum(axis=0)


def _group(plan: layout.LeafPlan, shape: tuple[int, ...]) -> int:
    """Values of one quantization scale along a row: a tile of columns, the row, or all."""
    tiles = dict(plan.tiled_axes)
    if 1 in tiles:
        return int(tiles[1])
    return shape[1] if 0 in plan.channelwise_axes else int(np.prod(shape))


def candidate(x_mean: np.ndarray, w_mean: np.ndarray | None, ratio: float, duo: bool) -> np.ndarray:
    """One grid point's s (module docstring), float32 on the host (one entry per channel: no
    compilation per shape for so little work)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = x_mean**ratio / (w_mean ** (1 - ratio) + 1e-4) if duo else x_mean**ratio
        s = np.maximum(s, np.float32(1e-4))
        s = s / np.sqrt(s.max() * s.min())
    return np.where(np.isfinite(s), s, np.float32(1.0)).astype(np.float32)


def how_to_quantize(plan: layout.LeafPlan) -> qarray_parts.HowToQuantize:
    if plan.global_scale is not None:
        raise ValueError(
            f"{plan.path}: AWQ changes the weight its {plan.qtype} global scale was computed "
            "from; use a scheme without one (W4A16, W4A16_ASYM, W8A16, ...)"
        )
    return leaf.how_to_quantize(plan)


@functools.partial(jax.jit, static_argnames="how")
def fake_quantize(w: jax.Array, s: jax.Array, how: qarray_parts.HowToQuantize) -> jax.Array:
    """Q(W · s) / s in float32 throughout: W · s as the fold keeps a linear it quantizes
    (folds.apply's keep_float32), its scales, and the result. Rounding any of them to a bf16
    checkpoint's 8 bits here (the stored scale is rounded so) would score the rounding, not the
    quantization: where s protects a salient channel its quantization error is near zero and
    bf16's 2^-9 times that channel's large activations dominates it (SmolLM2-135M: the grid's
    errors moved by up to 15 % and the choice with them, while bf16 scales cost the finished
    model nothing measurable: docs/calibrated-methods.md)."""
    ws = w.astype(_F32) * s
    codes, scale, zero_point = qarray_parts.quantize_bytes(ws, how)
    deq = qarray_parts.dequantize_bytes(codes, how.qtype, scale, zero_point)
    return deq.astype(_F32) / s


@jax.jit
def _linear(w: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.einsum("...i,oi->...o", x, w.astype(_F32), precision="highest")


def block(cfg: config_lib.LmConfig, layer: int, fold: folds_lib.Fold) -> Callable:
    """f(weights, x) -> the output of the block fed by the fold's linears (module docstring);
    biases of the last linear left out (they cancel in the error)."""
    if fold.name == "attn_in":
        attend = forward.stage_fn(cfg, layer, 1)
        return lambda w, x: _linear(w["self_attn.o_proj.weight"], attend(w, {"h": x, "x": x})["x"])
    if fold.name == "mlp_in":
        gated = forward.stage_fn(cfg, layer, 3)
        return lambda w, x: _linear(w["mlp.down_proj.weight"], gated(w, {"h": x, "x": x})["x"])
    (name,) = fold.balance
    return lambda w, x: _linear(w[name], x)


@jax.jit
def _squared_error(y: jax.Array, target: jax.Array) -> jax.Array:
    d = y - target
    return jnp.sum(d * d)


@jax.jit
def _hessian_error(w: jax.Array, w_hat: jax.Array, h: jax.Array) -> jax.Array:
    d = w.astype(_F32) - w_hat
    return jnp.sum(jnp.matmul(d, h, precision="highest") * d)


def search(
    cfg: config_lib.LmConfig,
    layer: int,
    fold: folds_lib.Fold,
    weights: Mapping[str, jax.Array],
    xs: Sequence[jax.Array],
    plans: Mapping[str, layout.LeafPlan],
    options: AwqOptions,
) -> tuple[jax.Array, dict[str, Any]]:
    """The scale of smallest block-output error for `fold` on the calibration inputs `xs`, and
    {"ratio", "duo_scaling", "error", "rtn_error"} for the report.

    Raises:
      ValueError: no finite error on the grid (NaN in the block's output), or a plan AWQ cannot
        follow.
    """
    quantized = [n for n in fold.balance if n in plans]
    hows = {n: how_to_quantize(plans[n]) for n in quantized}
    x_mean = np.asarray(folds_lib.reduce(fold, activation_mean(xs)), np.float32)
    w_mean = None
    if options.duo_scaling:
        w_mean = weight_mean([weights[n] for n in quantized], [plans[n] for n in quantized])
        w_mean = np.asarray(folds_lib.reduce(fold, w_mean), np.float32)
    error = _error_fn(cfg, layer, fold, weights, xs)
    best, history = None, []
    for ratio, duo in grid(options):
        s = candidate(x_mean, w_mean, ratio, duo)
        full = folds_lib.expand(fold, s)
        trial = dict(weights)
        for n in quantized:
            trial[n] = fake_quantize(jnp.asarray(weights[n]), full, hows[n])
        err = error(trial)
        history.append(err)
        if np.isfinite(err) and (best is None or err < best[0]):
            best = (err, ratio, duo, s)
    if best is None:
        raise ValueError(
            f"layer {layer} {fold.name}: AWQ found no finite output error on its grid (NaN in "
            "the float model's activations?)"
        )
    err, ratio, duo, s = best
    info = {"ratio": ratio, "duo_scaling": duo, "error": err, "rtn_error": history[0]}
    return s, info


def _error_fn(cfg, layer, fold, weights, xs) -> Callable[[Mapping[str, jax.Array]], float]:
    """error(trial weights): the mean squared block-output error against the float weights'.
    A single linear's from its Hessian when that is the cheaper product (in_features² per
    output row, against tokens · in_features)."""
    tokens = sum(int(np.prod(x.shape[:-1])) for x in xs)
    if fold.name in ("attn_out", "mlp_mid") and xs[0].shape[-1] <= tokens:
        (name,) = fold.balance
        h = sum(gram(x) for x in xs)
        count = tokens * weights[name].shape[0]
        w = jnp.asarray(weights[name])
        return lambda trial: float(_hessian_error(w, trial[name], h)) / count
    run = block(cfg, layer, fold)
    targets = [run(weights, x) for x in xs]
    count = sum(t.size for t in targets)

    def error(trial: Mapping[str, jax.Array]) -> float:
        pairs = zip(xs, targets, strict=True)
        return sum(float(_squared_error(run(trial, x), t)) for x, t in pairs) / count

    return error


@jax.jit
def gram(x: jax.Array) -> jax.Array:
    x = x.reshape(-1, x.shape[-1]).astype(_F32)
    return jnp.matmul(x.T, x, precision="highest")
