"""Noise for stochastic rounding, as the seeds name it.

Rounding ``x / scale + u`` to nearest, with u uniform in [-0.5, 0.5), rounds up with probability
equal to the fractional part: the quantized value is unbiased over draws. The noise varies along
``channelwise_noise_axes`` only and has size 1 on the other axes (it broadcasts), which costs
fewer random numbers and stays unbiased per element.

``get_noise_fn`` returns a ``NoiseFn``: a pytree (its key is the leaf), so a config holding one
can cross ``jax.jit`` as an argument, and the noise it draws keeps the reduced shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

# Levels of the low-bit noise: 8 bits.
_LOW_BIT_LEVELS = 256


def _noise_shape(shape: Sequence[int], channelwise_noise_axes: Sequence[int]) -> tuple[int, ...]:
    varying = {a % len(shape) for a in channelwise_noise_axes} if len(shape) else set()
    return tuple(d if a in varying else 1 for a, d in enumerate(shape))


def _key_and_shape(first: Any, second: Any, key: Any) -> tuple[jax.Array, tuple[int, ...]]:
    """(key, shape) from the two spellings: ``f(shape, key=k)`` and the reference's positional
    ``f(key, shape)`` (a shape is a sequence of ints; a key is an array)."""
    if key is not None:
        return key, tuple(first)
    if second is None:
        raise TypeError("noise needs a key: f(shape, key=key) or f(key, shape)")
    if isinstance(first, Sequence):
        return second, tuple(first)
    return first, tuple(second)


def uniform_noise(
    shape: Any,
    key_or_shape: Any = None,
    *,
    key: jax.Array | None = None,
    channelwise_noise_axes: Sequence[int] = (0,),
) -> jax.Array:
    """float32 noise uniform in [-0.5, 0.5), of ``shape`` with size 1 off the noise axes.

    ``uniform_noise(shape, key=k)`` or ``uniform_noise(k, shape)``.
    """
    key, shape = _key_and_shape(shape, key_or_shape, key)
    return jax.random.uniform(key, _noise_shape(shape, channelwise_noise_axes), jnp.float32) - 0.5


def low_bit_uniform_noise(
    shape: Any,
    key_or_shape: Any = None,
    *,
    key: jax.Array | None = None,
    channelwise_noise_axes: Sequence[int] = (0,),
) -> jax.Array:
    """Like uniform_noise with 8-bit resolution: k / 256 - 0.5 for k uniform in 0..255."""
    key, shape = _key_and_shape(shape, key_or_shape, key)
    drawn = _noise_shape(shape, channelwise_noise_axes)
    levels = jax.random.randint(key, drawn, 0, _LOW_BIT_LEVELS).astype(jnp.float32)
    return levels / _LOW_BIT_LEVELS - 0.5


NOISE = {"uniform": uniform_noise, "low_bit_uniform": low_bit_uniform_noise}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a key array has no hash
class NoiseFn:
    """A noise function for HowToQuantize.noise_fn: ``fn(shape)`` draws noise of ``shape``
    reduced to size 1 off ``channelwise_noise_axes`` (it broadcasts where it is added).

    A pytree whose only leaf is the key, so configs holding it pass through jit.
    """

    key: jax.Array
    method: str = dataclasses.field(default="uniform", metadata={"static": True})
    channelwise_noise_axes: tuple[int, ...] = dataclasses.field(
        default=(0,), metadata={"static": True}
    )
    # Broadcast the noise to the whole shape (the same values; qt.stochastic_noise_fn's form).
    full_shape: bool = dataclasses.field(default=False, metadata={"static": True})

    def __call__(self, shape: Sequence[int]) -> jax.Array:
        draw = NOISE[self.method]
        noise = draw(tuple(shape), key=self.key, channelwise_noise_axes=self.channelwise_noise_axes)
        return jnp.broadcast_to(noise, tuple(shape)) if self.full_shape else noise


def get_noise_fn(
    method: str, key: jax.Array, channelwise_noise_axes: Sequence[int] = (0,)
) -> NoiseFn:
    """The noise function of stochastic rounding ``method`` ("uniform" or "low_bit_uniform")."""
    if method not in NOISE:
        raise ValueError(
            f"Unsupported stochastic rounding method {method!r}; expected 'uniform' or "
            "'low_bit_uniform'"
        )
    return NoiseFn(key, method, tuple(int(a) for a in channelwise_noise_axes))
