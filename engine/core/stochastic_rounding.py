"""Noise for stochastic rounding, as the seeds name it.

Rounding ``x / scale + u`` to nearest, with u uniform in [-0.5, 0.5), rounds up with probability
equal to the fractional part: the quantized value is unbiased over draws. The noise varies along
``channelwise_noise_axes`` only and has size 1 on the other axes (it broadcasts), which costs
fewer random numbers and stays unbiased per element.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

# Levels of the low-bit noise: 8 bits.
_LOW_BIT_LEVELS = 256


def _noise_shape(shape: Sequence[int], channelwise_noise_axes: Sequence[int]) -> tuple[int, ...]:
    varying = {a % len(shape) for a in channelwise_noise_axes} if len(shape) else set()
    return tuple(d if a in varying else 1 for a, d in enumerate(shape))


def uniform_noise(
    shape: Sequence[int], *, key: jax.Array, channelwise_noise_axes: Sequence[int] = (0,)
) -> jax.Array:
    """float32 noise uniform in [-0.5, 0.5), of ``shape`` with size 1 off the noise axes."""
    return jax.random.uniform(key, _noise_shape(shape, channelwise_noise_axes), jnp.float32) - 0.5


def low_bit_uniform_noise(
    shape: Sequence[int], *, key: jax.Array, channelwise_noise_axes: Sequence[int] = (0,)
) -> jax.Array:
    """Like uniform_noise with 8-bit resolution: k / 256 - 0.5 for k uniform in 0..255."""
    drawn = _noise_shape(shape, channelwise_noise_axes)
    levels = jax.random.randint(key, drawn, 0, _LOW_BIT_LEVELS).astype(jnp.float32)
    return levels / _LOW_BIT_LEVELS - 0.5


NOISE = {"uniform": uniform_noise, "low_bit_uniform": low_bit_uniform_noise}
