"""Inputs shared by make_contrib_golden.py (the reference) and contrib_golden_test.py (qmill),
and the whole-model tests' Linen MLP (gptq_model_test.py, awq_sq_model_test.py)."""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn


def inputs() -> dict[str, np.ndarray]:
    """A weight (16, 128), GPTQ inputs (128, 256) with heavy tails, activations (64, 128) with
    every 16th channel 30x larger (what AWQ and SmoothQuant act on)."""
    k = jax.random.split(jax.random.key(25), 4)
    w = jax.random.normal(k[0], (16, 128), jnp.float32)
    x = jax.random.t(k[1], 5, (128, 256), jnp.float32)
    outliers = jnp.ones(128).at[::16].set(30.0)
    acts = jax.random.normal(k[2], (64, 128), jnp.float32) * outliers
    return {"w": np.asarray(w), "x": np.asarray(x), "acts": np.asarray(acts)}


def digest(data: dict[str, np.ndarray]) -> bytes:
    return hashlib.sha256(b"".join(data[k].tobytes() for k in sorted(data))).digest()


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16)(nn.gelu(nn.Dense(32)(x)))


class ReluMlp(nn.Module):
    """64 → 32, relu, → 8: the whole-model tests' MLP. Its layers' names are a field because
    Linen seeds each layer's init from its name: each test keeps the names (and weights) its
    rules and assertions use."""

    names: tuple[str, str] = ("hidden", "out")

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32, name=self.names[0])(x))
        return nn.Dense(8, name=self.names[1])(h)


GPTQ_CASES = (("int4_g32_b64", "int4", 32, 64), ("int8_b128", "int8", None, 128))


def bits(a) -> np.ndarray:
    """Floats as their raw bits, integers as int32: compared with array_equal, bit for bit."""
    a = np.asarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a.astype(np.int32)
