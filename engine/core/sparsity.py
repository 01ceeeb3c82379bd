"""N:M structured and unstructured magnitude sparsity masks (the reference's sparsity core).

Lingo:
  N:M     in every group of M values at most N stay non-zero: the N largest by magnitude.
  order   "R": groups run along the last axis (rows, e.g. activations); "C": along the
          second-to-last axis (columns; a weight's reduction axis).
  offset  0 or 1: a group is M adjacent values; k > 1: a group is M values k apart (k = 128
          matches an accelerator's lane layout), taken from chunks of M·k consecutive values.
  block   block_size > 1: consecutive values along the grouping axis are scored together
          (sum of |x|) and kept or pruned as one.
Masks are boolean, True where a value is kept.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True, kw_only=True)
class HowToSparsify:
    """N:M sparsity of one tensor (see the module docstring for the fields)."""

    n: int
    m: int
    order: str = "R"
    block_size: int = 0
    offset: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparsityRule:
    """The reference's sparsity configuration; `sparsify` uses its weight_sparsity_* fields
    (m = 0: no sparsity). The activation and schedule fields are carried for compatibility."""

    weight_sparsity_n: int = 0
    weight_sparsity_m: int = 0
    weight_sparsity_order: str = "R"
    weight_sparsity_block_size: int = 0
    weight_sparsity_offset: int = 0
    weight_sparsity_start_step: int = 0
    weight_sparsity_update_step: int = 1
    eval_mode: bool = False
    activation_sparsity_n: int = 0
    activation_sparsity_m: int = 0
    activation_sparsity_order: str = "R"
    activation_sparsity_block_size: int = 0
    activation_sparsity_offset: int = 0
    compress_weights: bool = False
    sparse_axis: int = 0


def _check(size: int, n: int, m: int, order: str, offset: int) -> None:
    if not 0 <= n <= m or m <= 0:
        raise ValueError(f"N:M sparsity needs 0 <= N <= M and M > 0, got {n}:{m}")
    if order not in ("R", "C"):
        raise ValueError(f"order must be 'R' (rows) or 'C' (columns), got {order!r}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    if size % m:
        raise ValueError(f"the array's size {size} must be divisible by M = {m}")


def _top_n_mask(scores: jax.Array, n: int, m: int, offset: int) -> jax.Array:
    """Keeps the n largest of every group of m along the last axis (or over the whole array
    when the last axis does not hold whole groups)."""
    stride = max(offset, 1)
    shape = scores.shape
    if shape[-1] % (m * stride) == 0:
        lead = shape[:-1]
        chunks = shape[-1] // (m * stride)
    else:
        if scores.size % (m * stride):
            raise ValueError(
                f"with offset {offset} the array's size {scores.size} must be a multiple of "
                f"M·offset = {m * stride}"
            )
        lead, chunks = (), scores.size // (m * stride)
    # (..., chunk, m, stride): a group is one (chunk, stride) position across the m axis.
    grouped = jnp.swapaxes(scores.reshape((*lead, chunks, m, stride)), -1, -2)
    if n == 0:
        keep = jnp.zeros(grouped.shape, jnp.bool_)
    else:
        _, idx = jax.lax.top_k(grouped, n)
        keep = jnp.any(jax.nn.one_hot(idx, m, dtype=jnp.bool_), axis=-2)
    return jnp.swapaxes(keep, -1, -2).reshape(shape)


def get_sparsity_mask(
    inputs: jax.Array,
    n_sparsity: int = 0,
    m_sparsity: int = 0,
    order: str = "R",
    block_size: int = 0,
    offset: int = 0,
) -> jax.Array:
    """Boolean N:M mask of `inputs` (True: kept), by magnitude.

    Raises:
      ValueError: N > M, an unknown order, a negative offset, or sizes M (or M·offset) does
        not divide.
    """
    _check(inputs.size, n_sparsity, m_sparsity, order, offset)
    x = jnp.abs(inputs)
    if order == "C":
        if x.ndim < 2:
            raise ValueError("order 'C' needs an array of rank >= 2")
        x = jnp.swapaxes(x, -1, -2)
    if block_size > 1:
        if x.shape[-1] % block_size:
            raise ValueError(
                f"block_size {block_size} must divide the grouping axis of size {x.shape[-1]}"
            )
        scores = jnp.sum(x.reshape((*x.shape[:-1], -1, block_size)), axis=-1)
        mask = _top_n_mask(scores, n_sparsity, m_sparsity, offset)
        mask = jnp.repeat(mask, block_size, axis=-1)
    else:
        mask = _top_n_mask(x, n_sparsity, m_sparsity, offset)
    return jnp.swapaxes(mask, -1, -2) if order == "C" else mask


def apply_sparsity(
    inputs: jax.Array,
    mask: jax.Array,
    is_channelwise: bool = False,
    pruned_value: jax.Array | float | None = None,
) -> jax.Array:
    """`inputs` where `mask` is True, else 0 (or `pruned_value`); a channelwise mask broadcasts."""
    if is_channelwise:
        mask = jnp.broadcast_to(mask, inputs.shape)
    fill = jnp.zeros((), inputs.dtype) if pruned_value is None else pruned_value
    if pruned_value is not None:
        # The reference multiplies: a pruned value becomes inputs · pruned_value.
        return inputs * jnp.where(mask, jnp.ones((), inputs.dtype), fill).astype(inputs.dtype)
    return jnp.where(mask, inputs, fill)


def get_sparsity_mask_unstructured(
    inputs: jax.Array, mask: jax.Array | None, prune_rate: jax.Array | float
) -> jax.Array:
    """Keeps the values above the `prune_rate` percentile (0..100) of |inputs|; values already
    pruned by `mask` stay pruned."""
    if mask is not None:
        inputs = apply_sparsity(inputs, mask)
    magnitude = jnp.abs(inputs)
    return magnitude > jnp.percentile(magnitude, prune_rate)


def prune_inputs_n_m(
    inputs: jax.Array, *, n: int, m: int, order: str = "R", offset: int = 0
) -> jax.Array:
    """`inputs` with N:M pruning applied (pruned values set to 0)."""
    return apply_sparsity(inputs, get_sparsity_mask(inputs, n, m, order=order, offset=offset))


def sparsify(array: jax.Array, how: HowToSparsify | SparsityRule) -> jax.Array:
    """`array` pruned as `how` says (a HowToSparsify, or a SparsityRule's weight settings; a
    rule with weight_sparsity_m = 0 leaves the array as is)."""
    if isinstance(how, SparsityRule):
        if how.weight_sparsity_m == 0:
            return array
        how = HowToSparsify(
            n=how.weight_sparsity_n,
            m=how.weight_sparsity_m,
            order=how.weight_sparsity_order,
            block_size=how.weight_sparsity_block_size,
            offset=how.weight_sparsity_offset,
        )
    mask = get_sparsity_mask(
        array, how.n, how.m, order=how.order, block_size=how.block_size, offset=how.offset
    )
    return apply_sparsity(array, mask)
