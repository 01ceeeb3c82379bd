"""The mixture-of-experts MLP block (Mixtral, Qwen2-MoE, Qwen3-MoE) in JAX: its forward pass and
its calibration, expert by expert, on the tokens the router sends to each.

Lingo:
  x        the block's input: the normed residual stream of one chunk, flattened to (N, D).
  route    per token, the top k experts of softmax(x @ router.T) (float32, as transformers
           computes them) and their probabilities, renormalized to sum to 1 where the config
           says (moe_config.Moe.normalize).
  rows     the tokens routed to one expert, padded with weight-0 rows to a power of two so that
           one compilation serves many counts; a padded row's input is zeroed, so it adds
           nothing to a Hessian (silu(0) * 0 = 0 for the down projection's input too).

Only one expert's rows and hidden activations are made at a time: never (experts × tokens ×
intermediate). The router (and Qwen2-MoE's shared-expert gate) stays in the source dtype's
values and is never quantized. Expert loops run eagerly (the row counts are data), each
expert's arithmetic jitted.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.lm import config as config_lib
from qmill.engine.lm import moe_config

_F32 = jnp.float32
_MIN_ROWS = 16


def _w(weights: Mapping[str, jax.Array], name: str) -> jax.Array:
    return jnp.asarray(weights[name]).astype(_F32)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _route(top_k: int, normalize: bool, router: jax.Array, x: jax.Array):
    logits = jnp.einsum("nd,ed->ne", x, router.astype(_F32), precision="highest")
    probs = jax.nn.softmax(logits, axis=-1)
    top, index = jax.lax.top_k(probs, top_k)
    if normalize:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, index


def route(cfg: config_lib.LmConfig, weights, x: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """(weights (N, k) float32, experts (N, k) int32) of the tokens x (N, D)."""
    moe = cfg.moe
    router = weights[moe_config.router(moe)]
    top, index = _route(moe.top_k, moe.normalize, jnp.asarray(router), x)
    return np.asarray(top), np.asarray(index)


def _bucket(n: int) -> int:
    return max(_MIN_ROWS, 1 << (n - 1).bit_length())


def padded_rows(tokens: np.ndarray, weights: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """Token indices and their weights padded to a bucket: (index, weight) with weight 0
    (and index 0) on the padding."""
    size = _bucket(len(tokens))
    index = np.zeros(size, np.int32)
    weight = np.zeros(size, np.float32)
    index[: len(tokens)] = tokens
    weight[: len(tokens)] = weights
    return jnp.asarray(index), jnp.asarray(weight)


def expert_rows(top: np.ndarray, index: np.ndarray, e: int | str):
    """(token indices, routing weights) of the tokens sent to expert e (the shared expert:
    every token, weight 1; its sigmoid gate is applied by the caller)."""
    if e == "shared":
        n = len(index)
        return np.arange(n, dtype=np.int32), np.ones(n, np.float32)
    tokens, slots = np.nonzero(index == e)
    return tokens.astype(np.int32), top[tokens, slots]


def _act(activation: str, x: jax.Array) -> jax.Array:
    if activation == "silu":
        return jax.nn.silu(x)
    return jax.nn.gelu(x, approximate=activation == "gelu_pytorch_tanh")


def _lin(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum("ni,oi->no", x, w.astype(_F32), precision="highest")


@jax.jit
def gather(x: jax.Array, index: jax.Array, count: jax.Array) -> jax.Array:
    """The rows of x at `index`, zero past the first `count` (the padding)."""
    valid = jnp.arange(index.shape[0]) < count
    return jnp.where(valid[:, None], jnp.take(x, index, axis=0), 0.0)


@functools.partial(jax.jit, static_argnums=0)
def hidden(activation: str, rows: jax.Array, gate: jax.Array, up: jax.Array) -> jax.Array:
    """An expert's down-projection input act(rows @ gate.T) * (rows @ up.T)."""
    return _act(activation, _lin(rows, gate)) * _lin(rows, up)


@functools.partial(jax.jit, donate_argnums=0)
def add_output(out, m, down, index, weight) -> jax.Array:
    """out (N, D) + each row's weight × (m @ down.T), scattered to its token."""
    return out.at[index].add(_lin(m, down) * weight[:, None])


@jax.jit
def _shared_gate(x: jax.Array, gate: jax.Array) -> jax.Array:
    return jax.nn.sigmoid(_lin(x, gate))[:, 0]


def token_weights(cfg, weights, top, index, x: jax.Array, e: int | str):
    """(tokens, weights) expert e's output is added with."""
    tokens, w = expert_rows(top, index, e)
    if e == "shared":
        w = np.asarray(_shared_gate(x, jnp.asarray(weights[moe_config.shared_gate(cfg.moe)])))
    return tokens, w


def block(cfg: config_lib.LmConfig, weights: Mapping[str, jax.Array], x: jax.Array) -> jax.Array:
    """The MoE block's output (B, T, D) float32 for its input x (B, T, D): the routed experts'
    weighted SwiGLU outputs (and the gated shared expert's), expert by expert."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1]).astype(_F32)
    top, index = route(cfg, weights, flat)
    out = jnp.zeros_like(flat)
    for e in moe_config.experts(cfg.moe):
        tokens, w = token_weights(cfg, weights, top, index, flat, e)
        if not len(tokens):
            continue
        rows, rw = padded_rows(tokens, w)
        gate, up, down = (_w(weights, n) for n in moe_config.expert(cfg.moe, e))
        m = hidden(cfg.activation, gather(flat, rows, len(tokens)), gate, up)
        out = add_output(out, m, down, rows, rw)
    return out.reshape(shape)
