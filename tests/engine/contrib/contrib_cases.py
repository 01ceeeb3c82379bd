"""Inputs shared by make_contrib_golden.py (the reference) and contrib_golden_test.py (qmill),
and the whole-model tests' Linen MLP (gptq_model_test.py, awq_sq_model_test.py)."""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from tests import random_inputs


def inputs() -> dict[str, np.ndarray]:
    """A weight (16, 128), GPTQ inputs (128, 256) with heavy tails, activations (64, 128) with
    every 16th channel 30x larger (what AWQ and SmoothQuant act on)."""
    k = jax.random.split(jax.random.key(25), 4)
    w = random_inputs.normal(k[0], (16, 128), jnp.float32)
    x = jax.random.t(k[1], 5, (128, 256), jnp.float32)
    outliers = jnp.ones(128).at[::16].set(30.0)
    acts = random_inputs.normal(k[2], (64, 128), jnp.float32) * outliers
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


class Branch(nn.Module):
    """QEP's shapes of stage: Dense_0 alone, DenseA and DenseB on one input, DenseC after.
    Every kernel (16, 16): one shape to compile."""

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(16)(x))
        a, b = nn.Dense(16, name="DenseA")(h), nn.Dense(16, name="DenseB")(h)
        return nn.Dense(16, name="DenseC")(jax.nn.relu(a + b))


# (name, weight_qtype, tile_size, gptq_block_size): groups of 4 in blocks of 8 of the 16 columns
# (group scales found from weights already moved by earlier blocks, the hardest path to match).
QEP_CASES = (("int4_g4_b8", "int4", 4, 8),)
KERNELS = (("Dense_0", "kernel"), ("DenseA", "kernel"), ("DenseB", "kernel"), ("DenseC", "kernel"))


def qep_inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]:
    """QEP's core inputs (W (16, 16), X (16, 256) and X_q, X coarsely rounded) from inputs(), and
    two model batches (8, 16): every shape the Branch model's."""
    data = inputs()
    w, x = data["w"][:, :16], data["x"][:16]
    batches = random_inputs.normal(jax.random.key(40), (2, 8, 16), jnp.float32)
    return w, x, np.round(x * 4) / 4, [np.asarray(b) for b in batches]


def codes(q) -> np.ndarray:
    """A QArray's codes for array_equal: float codes (fp4, fp8) as their f32 bits, integers as
    int32 (bits() would truncate fp4's 1.5 to 1)."""
    qvalue = np.asarray(q.qvalue)
    if np.issubdtype(qvalue.dtype, np.integer):
        return qvalue.astype(np.int32)
    return np.asarray(qvalue, np.float32).view(np.uint32)


# Padded PTQ: a contracted axis of 40, tiles of 16 and 32 not dividing it.
PAD_T, PAD_E, PAD_D, PAD_F = 4, 3, 40, 8
# (name, weight_qtype, act_qtype, tile_size)
PAD_CASES = (("int8_a8_t16", "int8", "int8", 16), ("fp4_t32", "float4_e2m1fn", None, 32))


def padded_inputs() -> tuple[np.ndarray, np.ndarray]:
    """x (T, D) and w (E, D, F) for the padded einsum 'td,edf->tef'."""
    k = jax.random.split(jax.random.key(42))
    x = random_inputs.normal(k[0], (PAD_T, PAD_D), jnp.float32)
    w = random_inputs.normal(k[1], (PAD_E, PAD_D, PAD_F), jnp.float32)
    return np.asarray(x), np.asarray(w)
