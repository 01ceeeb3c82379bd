"""The Flax Linen modules of the model zoo (engine/programs/zoo.py builds them).

Apart from zoo so that listing the zoo's models (the server's GetCapabilities, its start-up)
imports no Flax: zoo imports this module on a model's first build. The configs are zoo's; they
are not imported here (zoo imports this module: that would be a circle).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn


class Mlp(nn.Module):
    config: Any  # zoo.MlpConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        for width in self.config.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.config.out_features)(x)


class Cnn(nn.Module):
    """With the defaults, the digits CNN of tests/engine/providers/digits_test.py (same names)."""

    config: Any  # zoo.CnnConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for c in self.config.channels:
            x = nn.relu(nn.Conv(c, (3, 3))(x))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(self.config.hidden)(x))
        return nn.Dense(self.config.num_classes)(x)


class _Block(nn.Module):
    config: Any  # zoo.TransformerEncoderConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        head_dim = c.d_model // c.num_heads
        y = nn.LayerNorm()(x)
        # Explicit Dense + einsum (not nn.MultiHeadDotProductAttention) so every matmul is an op
        # the quantization providers intercept, with a plain 2-D kernel.
        q, k, v = (
            nn.Dense(c.d_model, name=n)(y).reshape(*y.shape[:-1], c.num_heads, head_dim)
            for n in ("query", "key", "value")
        )
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim).astype(x.dtype)
        attn = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
        x = x + nn.Dense(c.d_model, name="out")(attn.reshape(*x.shape[:-1], c.d_model))
        y = nn.LayerNorm()(x)
        y = nn.Dense(c.d_model)(nn.gelu(nn.Dense(c.mlp_dim)(y)))
        return x + y


class TransformerEncoder(nn.Module):
    config: Any  # zoo.TransformerEncoderConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        x = nn.Embed(c.vocab_size, c.d_model)(tokens.astype(jnp.int32))
        x = x + self.param("pos", nn.initializers.normal(0.02), (c.seq_len, c.d_model))
        for i in range(c.num_layers):
            x = _Block(c, name=f"block_{i}")(x)
        return nn.Dense(c.num_classes)(nn.LayerNorm()(x).mean(axis=1))
