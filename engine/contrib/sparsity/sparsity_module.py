"""SparsityModule: N:M sparsity of an op's activations and weights, its weight mask kept as state.

Lingo:
  N:M       of every M consecutive values (along the sparsified axis, core/sparsity.py) the N
            largest are kept, the others zeroed.
  mask      the weights' boolean keep-mask. It is recomputed from the weights at the rule's
            update steps (``weight_sparsity_start_step``, then every
            ``weight_sparsity_update_step``), and held in between, so the pruned pattern only
            moves when the rule says; activations get a fresh mask on every call.
  step      calls counted so far (not in ``eval_mode``, which applies the mask as it stands).

Both are ``nnx.BatchStat`` variables: model state that training updates, not parameters.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from qmill.engine.core import sparsity


class SparsityModule(nnx.Module):
    """Applies a SparsityRule's activation and weight sparsity: ``inputs, weight = module(inputs,
    weight)`` before the op that reads them.

    Args:
      shape: the weight's shape (the mask's).
      sharding_axes: the mask's sharding (the weight's axis names).
      sparsity_rule: what to sparsify; None leaves both as they are.
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        sharding_axes: tuple[Any, ...],
        sparsity_rule: sparsity.SparsityRule | None = None,
    ) -> None:
        self.sparsity_rule = sparsity_rule
        self.step = nnx.BatchStat(jnp.zeros((), jnp.int32))
        # Flax 0.12 names the axes out_sharding (the reference, on an older Flax: sharding).
        self.mask = nnx.BatchStat(jnp.ones(shape, jnp.bool_), out_sharding=sharding_axes)

    def __call__(self, inputs: jax.Array, weight: jax.Array) -> tuple[jax.Array, jax.Array]:
        rule = self.sparsity_rule
        if rule is None:
            return inputs, weight
        if rule.activation_sparsity_m:
            keep = sparsity.get_sparsity_mask(
                inputs,
                n_sparsity=rule.activation_sparsity_n,
                m_sparsity=rule.activation_sparsity_m,
                order=rule.activation_sparsity_order,
                block_size=rule.activation_sparsity_block_size,
                offset=rule.activation_sparsity_offset,
            )
            inputs = jnp.where(keep, inputs, jnp.zeros_like(inputs))
        if rule.weight_sparsity_m:
            if not rule.eval_mode:
                self.mask.set_value(self._next_mask(weight, self.step.get_value()))
                self.step.set_value(self.step.get_value() + 1)
            weight = jnp.where(self.mask.get_value(), weight, jnp.zeros_like(weight))
        return inputs, weight

    def _next_mask(self, weight: jax.Array, step: jax.Array) -> jax.Array:
        """The weight mask after this step: recomputed from ``weight`` at an update step, else the
        one held (cut to the weight's shape where it was made larger)."""
        rule = self.sparsity_rule
        held = self.mask.get_value()
        if held.shape != weight.shape:
            held = held[tuple(slice(0, n) for n in weight.shape)]
        since_start = step - rule.weight_sparsity_start_step
        update = (since_start >= 0) & (since_start % rule.weight_sparsity_update_step == 0)

        def recompute(w: jax.Array, _: jax.Array) -> jax.Array:
            return sparsity.get_sparsity_mask(
                w,
                n_sparsity=rule.weight_sparsity_n,
                m_sparsity=rule.weight_sparsity_m,
                order=rule.weight_sparsity_order,
                block_size=rule.weight_sparsity_block_size,
                offset=rule.weight_sparsity_offset,
            )

        return jax.lax.cond(update, recompute, lambda _, mask: mask, weight, held)
