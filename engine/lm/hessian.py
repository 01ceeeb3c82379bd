"""GPTQ's statistic of a linear's input: H = Σ xᵀx over every token, summed chunk by chunk
(its scale does not matter: GPTQ's dampening is relative to its mean diagonal); and QEP's second
one, H_delta = Σ (x_float − x)ᵀx, summed over the same tokens (so on the same scale as H).

One jitted product per chunk, of the feature blocks on and above the diagonal only (H is
symmetric), at HIGHEST precision (a GPU would otherwise multiply float32 in TF32). numpy's
`x.T @ x` (BLAS's symmetric rank-k update) was tried on the host: 25 % faster on one core, but
on the VM's two cores OpenBLAS's threads beside XLA's made a 4-layer calibration 15 % slower
(45.3 vs 39.5 s), so the sum stays in XLA on every platform.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import jax
import jax.numpy as jnp


def add(h: jax.Array | None, x: jax.Array) -> jax.Array:
    """h + xᵀx over x's tokens (every axis but the last); h None: xᵀx alone."""
    if h is None:
        h = jnp.zeros((x.shape[-1],) * 2, jnp.float32)
    return _add(h, x)


def of(inputs: Iterable[jax.Array]) -> jax.Array:
    """Σ xᵀx over every chunk of `inputs` (at least one)."""
    h = None
    for x in inputs:
        h = add(h, x)
    if h is None:
        raise ValueError("a Hessian needs at least one chunk of inputs")
    return h


# Feature blocks of about this width: only the blocks on and above the diagonal are multiplied
# (k(k+1)/2 of k² products: 58 % of the work for 1536 features).
_BLOCK = 256


@jax.jit
def _add(h: jax.Array, x: jax.Array) -> jax.Array:
    x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    n = x.shape[1]
    k = max(1, n // _BLOCK)
    edges = [n * i // k for i in range(k + 1)]
    blocks = [x[:, a:b] for a, b in itertools.pairwise(edges)]
    products = {
        (i, j): jnp.matmul(blocks[i].T, blocks[j], precision=jax.lax.Precision.HIGHEST)
        for i in range(k)
        for j in range(i, k)
    }
    full = [[products[min(i, j), max(i, j)] for j in range(k)] for i in range(k)]
    full = [[p if j >= i else p.T for j, p in enumerate(row)] for i, row in enumerate(full)]
    return h + jnp.block(full)


def add_delta(h_delta: jax.Array | None, x_float: jax.Array, x: jax.Array) -> jax.Array:
    """h_delta + (x_float − x)ᵀx over the tokens of a chunk that the float model (x_float) and
    the partly quantized one (x) saw alike; h_delta None: that product alone. Not symmetric:
    the full product."""
    if x_float.shape != x.shape:
        raise ValueError(f"paired inputs differ in shape: {x_float.shape} and {x.shape}")
    if h_delta is None:
        h_delta = jnp.zeros((x.shape[-1],) * 2, jnp.float32)
    return _add_delta(h_delta, x_float, x)


@jax.jit
def _add_delta(h_delta: jax.Array, x_float: jax.Array, x: jax.Array) -> jax.Array:
    x = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    delta = x_float.reshape(x.shape).astype(jnp.float32) - x
    return h_delta + jnp.matmul(delta.T, x, precision=jax.lax.Precision.HIGHEST)
