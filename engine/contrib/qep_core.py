"""QEP (quantization error propagation, Arai & Ichikawa 2025, arXiv:2504.09629): the tensor maths.

GPTQ quantizes a layer as if its inputs were the float model's. After earlier layers are
quantized, a layer really sees X_q, not X. QEP first moves the float weight so that W' · X_q
approaches W · X, then GPTQ-quantizes W' on the Hessian of X_q.

Lingo (GPTQ's, see gptq_core):
  W        (rows, columns): output rows × input (contracted) columns.
  X, X_q   (columns, samples): a layer's inputs in the float model and in the partly quantized one.
  H        X_q · X_qᵀ, the Hessian GPTQ minimizes the output error on.
  H_delta  (X − X_q) · X_qᵀ, how the input error correlates with the inputs seen.

The correction is the least-squares one, W' = W + α · W · H_delta · (H + λ)⁻¹, with α
(`correction_factor`) shrinking it (the paper's 0.5 by default: the full step over-fits the
calibration set) and λ the damping (`damping_factor` × mean(diag H)).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qmill.engine.contrib import gptq_core


def compute_qep_stats(X_q: jax.Array, X_float: jax.Array) -> dict[str, jax.Array]:
    """Statistics of one batch of paired inputs (in_features, samples): `hessian` X_q·X_qᵀ and
    `hessian_delta` (X_float − X_q)·X_qᵀ, both (in_features, in_features)."""
    return {"hessian": X_q @ X_q.T, "hessian_delta": (X_float - X_q) @ X_q.T}


def weight_correct(
    W: jax.Array,
    H: jax.Array,
    H_delta: jax.Array,
    *,
    correction_factor: float = 0.5,
    damping_factor: float = 0.01,
) -> jax.Array:
    """W (rows, columns) moved so that W' · X_q approaches W · X (see the module's docstring).

    A column whose input was always zero (diag H = 0) carries nothing: its weights become zero
    and its Hessian entry one, as GPTQ treats it. Compiled as one function (one compilation a
    shape instead of one an op; the same bits as op-by-op, checked against the reference's).

    Raises:
      ValueError: shapes that don't fit together.
    """
    columns = W.shape[1]
    if H.shape != (columns, columns) or H_delta.shape != (columns, columns):
        raise ValueError(
            f"H {H.shape} and H_delta {H_delta.shape} must both be ({columns}, {columns}) for "
            f"W {W.shape}"
        )
    return _weight_correct(W, H, H_delta, correction_factor, damping_factor)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _weight_correct(W, H, H_delta, correction_factor, damping_factor):
    columns = W.shape[1]
    diag = jnp.diag(H)
    dead = diag == 0
    H = jnp.where(dead & jnp.eye(columns, dtype=bool), 1.0, H)
    W = jnp.where(dead, 0.0, W)
    index = jnp.arange(columns)
    # The damping is taken from the diagonal before dead columns were set to one.
    H = H.at[index, index].add(damping_factor * jnp.mean(diag))
    # H⁻¹ itself is needed here (not its Cholesky factor, as GPTQ's loop uses).
    inverse = gptq_core.cholesky_inverse(jnp.linalg.cholesky(H))
    return W + correction_factor * (W @ H_delta @ inverse)
