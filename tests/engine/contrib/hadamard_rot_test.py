"""contrib.hadamard_rot (issue 40): the reference's hadamard_rot_test cases."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qmill.engine.contrib import hadamard_rot
from tests import random_inputs


@pytest.mark.parametrize(
    ("power", "row_sign_flip", "col_sign_flip"),
    list(itertools.product(range(5, 8), [False, True], [False, True])),
)
def test_create_hadamard_matrix(power, row_sign_flip, col_sign_flip):
    had, _ = hadamard_rot._create_hadamard_matrix(
        power, jax.random.key(0), row_sign_flip=row_sign_flip, col_sign_flip=col_sign_flip
    )
    size = had.shape[0]
    assert size == 2**power and had.dtype == jnp.bfloat16
    np.testing.assert_allclose(jnp.dot(had, had.T), size * jnp.eye(size))


@pytest.mark.parametrize("idx", [0, 1, 2])
def test_apply_hadamard_keeps_the_shape(idx):
    powers = (2, 3, 4)
    x = jnp.ones(tuple(2**p for p in powers))
    had, _ = hadamard_rot._create_hadamard_matrix(
        powers[idx], jax.random.key(0), row_sign_flip=True, col_sign_flip=True
    )
    assert hadamard_rot._apply_hadamard_lhs(x, had, idx).shape == x.shape
    assert hadamard_rot._apply_hadamard_rhs(x, had, idx).shape == x.shape


def test_hadamard_rotate_multiply_identity():
    lhs, rhs, _ = hadamard_rot.hadamard_rotate_inputs(
        jnp.eye(16),
        jnp.eye(16),
        jax.random.key(0),
        row_sign_flip=True,
        col_sign_flip=True,
        lhs_reduction_dim=1,
        rhs_reduction_dim=0,
    )
    np.testing.assert_allclose(lhs @ rhs, jnp.eye(16), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("idx", "row_sign_flip", "col_sign_flip"),
    list(itertools.product((1, 2), [False, True], [False, True])),
)
def test_hadamard_rotate_keeps_the_product(idx, row_sign_flip, col_sign_flip):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    lhs = random_inputs.normal(k1, (4, 8, 16))
    rhs = random_inputs.normal(k2, (8, 16, 32))
    spec = "arb,rcd->abcd" if idx == 1 else "abr,crd->abcd"
    lhs_rot, rhs_rot, key = hadamard_rot.hadamard_rotate_inputs(
        lhs,
        rhs,
        k3,
        row_sign_flip=row_sign_flip,
        col_sign_flip=col_sign_flip,
        lhs_reduction_dim=idx,
        rhs_reduction_dim=idx - 1,
    )
    np.testing.assert_allclose(
        jnp.einsum(spec, lhs_rot, rhs_rot), jnp.einsum(spec, lhs, rhs), rtol=1e-4, atol=1e-4
    )
    # The key comes back unused without flips, else a fresh one.
    assert (key is k3) == (not (row_sign_flip or col_sign_flip))


def test_rotation_spreads_an_outlier():
    x = jnp.zeros((1, 64)).at[0, 3].set(100.0)
    rotated, _, _ = hadamard_rot.hadamard_rotate_inputs(
        x,
        jnp.eye(64),
        None,
        row_sign_flip=False,
        col_sign_flip=False,
        lhs_reduction_dim=1,
        rhs_reduction_dim=0,
    )
    np.testing.assert_allclose(jnp.abs(rotated), 100.0)  # the same energy on every channel


def test_construction_errors():
    with pytest.raises(ValueError):
        hadamard_rot._create_hadamard_matrix(-1, None, row_sign_flip=False, col_sign_flip=False)
    for row, col in ((True, False), (False, True), (True, True)):
        with pytest.raises(ValueError, match="Key must be provided"):
            hadamard_rot._create_hadamard_matrix(2, None, row_sign_flip=row, col_sign_flip=col)


@pytest.mark.parametrize(
    ("lhs_shape", "rhs_shape", "lhs_dim", "rhs_dim"),
    [
        ((2, 2, 2), (2, 2, 2), (1, 2), 2),
        ((2, 2, 2), (2, 2, 2), 1, (1, 2)),
        ((2, 4), (2, 3), 1, 0),
        ((2, 3), (2, 3), 1, 1),
    ],
)
def test_rotation_errors(lhs_shape, rhs_shape, lhs_dim, rhs_dim):
    with pytest.raises(ValueError):
        hadamard_rot.hadamard_rotate_inputs(
            jnp.ones(lhs_shape),
            jnp.ones(rhs_shape),
            jax.random.key(0),
            row_sign_flip=True,
            col_sign_flip=True,
            lhs_reduction_dim=lhs_dim,
            rhs_reduction_dim=rhs_dim,
        )
