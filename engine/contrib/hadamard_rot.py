"""Hadamard rotation of a dot's operands (the reference's qwix.contrib.hadamard_rot).

Lingo:
  H         a Sylvester Hadamard matrix of size d = 2^p (entries ±1, H Hᵀ = d I), optionally with
            random signs on its rows and / or columns (still H Hᵀ = d I).
  rotation  x ↦ x H along the activation's reduction axis and w ↦ Hᵀ w / d along the weight's:
            the product is unchanged ((x H)(Hᵀ w) / d = x w) while outliers of x are spread over
            all d channels, which makes 4-bit activations (W4A4, W4A8) usable.

``hadamard_rotate_inputs(act, weight, key, ...)`` rotates both operands of a dot with one
reduction axis each, returning them and the key left for the next rotation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

_LETTERS = "abcdefghijklmnopqrstuvwxy"  # "z" names the rotated axis


def _sylvester(power: int) -> np.ndarray:
    """The 2^power Sylvester Hadamard matrix as int8: H_{2n} = [[H, H], [H, -H]]."""
    if power < 0:
        raise ValueError(f"Power must be non-negative, got {power}.")
    had = np.ones((1, 1), np.int8)
    for _ in range(power):
        had = np.block([[had, had], [had, -had]])
    return had


def sylvester(power: int) -> np.ndarray:
    """The 2^power Sylvester Hadamard matrix (int8 ±1, H Hᵀ = 2^power I): the blocks of a
    language model's fused rotation (engine/lm/rotation.py).

    Raises:
      ValueError: a negative power.
    """
    return _sylvester(power)


def _create_hadamard_matrix(
    power: int,
    key: jax.Array | None,
    *,
    row_sign_flip: bool,
    col_sign_flip: bool,
    dtype: jnp.dtype = jnp.bfloat16,
) -> tuple[jax.Array, jax.Array | None]:
    """(H of size 2^power in ``dtype`` with the asked random sign flips, the key left).

    The key is split into one key per flip plus one returned for later use; without flips it is
    returned as is (and may be None).

    Raises:
      ValueError: a negative power, or a flip asked without a key.
    """
    had = jnp.asarray(_sylvester(power), dtype)
    flips = [flip for flip in (row_sign_flip, col_sign_flip) if flip]
    if not flips:
        return had, key
    if key is None:
        raise ValueError("Key must be provided if row_sign_flip or col_sign_flip is True.")
    keys = jax.random.split(key, len(flips) + 1)
    size = had.shape[0]
    used = 0
    for axis, flip in ((0, row_sign_flip), (1, col_sign_flip)):
        if not flip:
            continue
        signs = jax.random.choice(keys[used], jnp.array([-1, 1]), shape=(size,), replace=True)
        used += 1
        had = had * (signs.astype(dtype)[:, None] if axis == 0 else signs.astype(dtype)[None, :])
    return had, keys[-1]


def _subscripts(ndim: int, axis: int) -> tuple[str, str]:
    """(x's einsum subscripts, the same with ``axis`` renamed "z")."""
    letters = _LETTERS[:ndim]
    return letters, letters.replace(letters[axis], "z")


def _apply_hadamard_lhs(x: jax.Array, had: jax.Array, reduction_dim: int) -> jax.Array:
    """x H along ``reduction_dim`` (the activation's side)."""
    spec, out = _subscripts(x.ndim, reduction_dim)
    return jnp.einsum(f"{spec},{spec[reduction_dim]}z->{out}", x, had)


def _apply_hadamard_rhs(x: jax.Array, had: jax.Array, reduction_dim: int) -> jax.Array:
    """Hᵀ x / d along ``reduction_dim`` (the weight's side)."""
    spec, out = _subscripts(x.ndim, reduction_dim)
    return jnp.einsum(f"{spec[reduction_dim]}z,{spec}->{out}", had, x) / had.shape[0]


def hadamard_rotate_inputs(
    act: jax.Array,
    weight: jax.Array,
    key: jax.Array | None,
    *,
    row_sign_flip: bool,
    col_sign_flip: bool,
    lhs_reduction_dim: int,
    rhs_reduction_dim: int,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """(act H, Hᵀ weight / d, the key left): a dot of the results over the two reduction axes
    equals the dot of the inputs.

    Args:
      act: the activation (lhs) operand.
      weight: the weight (rhs) operand.
      key: for the random sign flips (None only without flips).
      row_sign_flip: random signs on H's rows.
      col_sign_flip: random signs on H's columns.
      lhs_reduction_dim: the one axis of ``act`` the dot contracts.
      rhs_reduction_dim: the one axis of ``weight`` the dot contracts.

    Raises:
      ValueError: a reduction dim that is not one int, sizes that differ or are not a power of 2.
    """
    for name, dim in (("lhs", lhs_reduction_dim), ("rhs", rhs_reduction_dim)):
        if not isinstance(dim, int):
            raise ValueError(f"Expected {name}_reduction_dim to be an integer, but got {dim}")
    size = act.shape[lhs_reduction_dim]
    if size != weight.shape[rhs_reduction_dim]:
        raise ValueError(
            "Expected reduction dimension sizes to be the same, but got "
            f"{size} and {weight.shape[rhs_reduction_dim]}"
        )
    if size & (size - 1):
        raise ValueError(f"Expected reduction dimension size to be a power of 2, but got {size}")
    had, key = _create_hadamard_matrix(
        int(math.log2(size)), key, row_sign_flip=row_sign_flip, col_sign_flip=col_sign_flip
    )
    act = _apply_hadamard_lhs(act, had, lhs_reduction_dim)
    return act, _apply_hadamard_rhs(weight, had, rhs_reduction_dim), key
