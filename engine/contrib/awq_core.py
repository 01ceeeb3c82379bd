"""AWQ (Lin et al., 2023, arXiv:2306.00978): scale each input channel of a weight up by a power
of its mean activation magnitude before quantizing, so that the channels that carry large inputs
lose less to rounding; the inference side divides the scale back out.

The exponent is found by grid search: for each ratio r in linspace(0, 1, n_grid),
  a = clip(act / (max(act) + 1e-8), 1e-4)            (normalized activation magnitudes)
  s = clip(a**r, 1e-4);  s = s / sqrt(max(max(s)·min(s), 1e-8))
  loss(r) = mean(((W − Q(W·s)/s) · act)²)             (activation-weighted weight error)
and the s of the smallest loss is kept (the first one on ties). The scales are per input channel,
shape (1, in_features), whatever the quantization's group size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qmill.engine.core import qarray


def compute_act_scale(x: jax.Array, axis: int = 0) -> jax.Array:
    """Mean |x| per channel, reducing the sample axis `axis` ((samples, in) for 0)."""
    return jnp.mean(jnp.abs(x), axis=axis)


def search_optimal_scales(
    w: jax.Array,
    activation_scales: jax.Array,
    how: qarray.HowToQuantize,
    n_grid: int = 20,
    min_scale: float = 1e-4,
) -> jax.Array:
    """The per-channel scales (1, in_features) of the grid ratio with the least weighted loss.

    w: (out_features, in_features), the contracted axis last; activation_scales: (in_features,).
    """
    ratios = jnp.linspace(0.0, 1.0, n_grid)
    normalized = jnp.clip(activation_scales / (activation_scales.max() + 1e-8), min=min_scale)
    weights = activation_scales.reshape(1, -1)

    def loss_and_scales(ratio: jax.Array) -> tuple[jax.Array, jax.Array]:
        s = jnp.clip(jnp.power(normalized, ratio), min=min_scale)
        s = (s / jnp.sqrt(jnp.maximum(s.max() * s.min(), 1e-8))).reshape(1, -1)
        restored = qarray.dequantize(qarray.quantize(w * s, how)) / s
        return jnp.mean(((w - restored) * weights) ** 2), s

    losses, scales = jax.vmap(loss_and_scales)(ratios)
    return scales[jnp.argmin(losses)]


def quantize_weight(
    w: jax.Array,
    activation_scales: jax.Array,
    how: qarray.HowToQuantize,
    n_grid: int = 20,
) -> tuple[qarray.QArray, jax.Array]:
    """(Q(w · s), s): the quantized scaled weight and its scales s (1, in_features).

    Dequantizing and dividing by s approximates w. Jittable (how and n_grid static).
    """
    scales = search_optimal_scales(w, activation_scales, how, n_grid)
    return qarray.quantize(w * scales, how), scales
