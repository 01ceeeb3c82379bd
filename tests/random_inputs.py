"""jax.random's normal and uniform draws for test inputs: the same numbers, far less compiling.

jax.random is counter-based: element i of a draw (row-major, any shape) is a function of the key
and i alone (jax's `iota_2x32_shape` numbers the elements), and each element becomes a float on
its own (uniform's bounds are arguments of the program here, as in jax.random's). So the draw of
any shape is the first prod(shape) numbers of a longer 1-D draw with the same key, reshaped:
`normal(key, shape)` here equals `jax.random.normal(key, shape)` bit for bit (checked by
tests/random_inputs_test.py).

Why: XLA compiles a draw anew for each shape, and on the CPU a 4-D one takes ~3.5 s of CPU to
compile (3-D ~2.3 s, 2-D ~0.3 s, 1-D ~0.2 s; measured on the 2-core dev VM, jax 0.10). The
engine tests draw their inputs in a hundred-odd shapes, at import time too (every xdist worker
imports every test module), and spent minutes of the suite compiling random numbers. Here a draw
is cut from a 1-D draw whose length is the next power of two: one compile per length and dtype
in a process.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike


def normal(key: jax.Array, shape: Sequence[int] = (), dtype: DTypeLike = float) -> jax.Array:
    """`jax.random.normal(key, shape, dtype)`, bit for bit."""
    size = math.prod(shape)
    return _cut(_normal(key, _length(size), _canonical(dtype)), size, shape)


def uniform(
    key: jax.Array,
    shape: Sequence[int] = (),
    dtype: DTypeLike = float,
    minval: float = 0.0,
    maxval: float = 1.0,
) -> jax.Array:
    """`jax.random.uniform(key, shape, dtype, minval, maxval)`, bit for bit."""
    size = math.prod(shape)
    return _cut(_uniform(key, _length(size), _canonical(dtype), minval, maxval), size, shape)


def _canonical(dtype: DTypeLike) -> jnp.dtype:
    """The dtype jax.random draws for `dtype` (float: float32 unless jax_enable_x64)."""
    return jax.dtypes.canonicalize_dtype(dtype)


def _length(size: int) -> int:
    return 1 << max(0, size - 1).bit_length()


def _cut(flat: jax.Array, size: int, shape: Sequence[int]) -> jax.Array:
    return jax.lax.slice(flat, (0,), (size,)).reshape(tuple(shape))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _normal(key: jax.Array, length: int, dtype: jnp.dtype) -> jax.Array:
    return jax.random.normal(key, (length,), dtype)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _uniform(key: jax.Array, length: int, dtype: jnp.dtype, minval, maxval) -> jax.Array:
    return jax.random.uniform(key, (length,), dtype, minval, maxval)
