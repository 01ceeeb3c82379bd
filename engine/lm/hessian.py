"""GPTQ's statistic of a linear's input: H = Σ xᵀx over every token, summed chunk by chunk
(its scale does not matter: GPTQ's dampening is relative to its mean diagonal).

Where the chunks live decides how it is summed. On the host (jax's CPU device, or numpy) with
numpy: BLAS computes `x.T @ x` as a symmetric rank-k update, half the products, and the sum is
updated in place — 25 % faster than XLA:CPU's blocked product below on one core of the 2-core
VM (1536 features, 2048 tokens: 131 vs 172 ms), whose transposed-operand dot is slow. On an
accelerator one jitted product per chunk, of the feature blocks on and above the diagonal only,
at HIGHEST precision (a GPU would otherwise multiply float32 in TF32). The two sum in different
orders, so their last bits differ, as any two BLAS builds' do.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

Hessian = np.ndarray | jax.Array


def add(h: Hessian | None, x: np.ndarray | jax.Array) -> Hessian:
    """h + xᵀx over x's tokens (every axis but the last); h None: xᵀx alone. A host sum is
    updated in place."""
    if _on_host(x):
        rows = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
        product = rows.T @ rows
        if h is None:
            return product
        h += product
        return h
    if h is None:
        h = jnp.zeros((x.shape[-1],) * 2, jnp.float32)
    return _add_on_device(h, x)


def of(inputs: Iterable[np.ndarray | jax.Array]) -> Hessian:
    """Σ xᵀx over every chunk of `inputs` (at least one)."""
    h = None
    for x in inputs:
        h = add(h, x)
    if h is None:
        raise ValueError("a Hessian needs at least one chunk of inputs")
    return h


def _on_host(x: np.ndarray | jax.Array) -> bool:
    if not isinstance(x, jax.Array):
        return True
    return all(device.platform == "cpu" for device in x.devices())


# Feature blocks of about this width: H is symmetric, so only the blocks on and above its
# diagonal are multiplied (k(k+1)/2 of k² products: 58 % of the work for 1536 features).
_BLOCK = 256


@jax.jit
def _add_on_device(h: jax.Array, x: jax.Array) -> jax.Array:
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
