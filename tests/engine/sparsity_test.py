"""N:M and unstructured sparsity masks vs small worked examples and a brute force."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qmill.engine import sparsity
from tests import random_inputs


def _brute(x: np.ndarray, n: int, m: int, offset: int) -> np.ndarray:
    """N:M along the last axis, groups of m values `offset` apart, by explicit loops."""
    stride = max(offset, 1)
    keep = np.zeros(x.shape, bool)
    for row in np.ndindex(x.shape[:-1]):
        for start in range(0, x.shape[-1], m * stride):
            for j in range(stride):
                pos = [start + k * stride + j for k in range(m)]
                best = sorted(pos, key=lambda p: -abs(x[(*row, p)]))[:n]
                for p in best:
                    keep[(*row, p)] = True
    return keep


@pytest.mark.parametrize(("n", "m", "offset"), [(2, 4, 0), (1, 4, 0), (1, 2, 4), (3, 4, 2)])
def test_n_m_rows_match_brute_force(n, m, offset) -> None:
    x = np.asarray(random_inputs.normal(jax.random.key(0), (3, 2, 32)))
    mask = sparsity.get_sparsity_mask(jnp.asarray(x), n, m, offset=offset)
    np.testing.assert_array_equal(mask, _brute(x, n, m, offset))
    assert int(mask.sum()) == x.size * n // m


def test_worked_example_and_columns() -> None:
    x = jnp.array([[1.0, -5.0, 3.0, 2.0, 0.5, 4.0, -6.0, 1.0]])
    out = sparsity.prune_inputs_n_m(x, n=2, m=4)
    np.testing.assert_array_equal(out, [[0, -5, 3, 0, 0, 4, -6, 0]])
    y = random_inputs.normal(jax.random.key(1), (8, 6))
    cols = sparsity.get_sparsity_mask(y, 2, 4, order="C")
    np.testing.assert_array_equal(cols, sparsity.get_sparsity_mask(y.T, 2, 4).T)


def test_blocks_are_kept_or_pruned_whole() -> None:
    x = jnp.array([[1.0, 1.0, 3.0, 0.0, 5.0, 5.0, 0.0, 0.0]])
    # Block scores (sum |x| of 2): [2, 3, 10, 0]; 1:2 keeps blocks 1 and 2.
    mask = sparsity.get_sparsity_mask(x, 1, 2, block_size=2)
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1, 1, 1, 0, 0]])
    how = sparsity.HowToSparsify(n=1, m=2, block_size=2)
    np.testing.assert_array_equal(sparsity.sparsify(x, how), [[0, 0, 3, 0, 5, 5, 0, 0]])


def test_groups_spanning_rows_use_the_flat_order() -> None:
    x = jnp.array([[1.0, 9.0], [2.0, 8.0], [7.0, 3.0]])  # last axis 2, groups of 3
    mask = sparsity.get_sparsity_mask(x, 1, 3)
    # Flat groups [1, 9, 2] and [8, 7, 3]: 9 and 8 are kept.
    np.testing.assert_array_equal(mask, [[0, 1], [0, 1], [0, 0]])


def test_unstructured_and_apply() -> None:
    x = jnp.arange(1.0, 11.0)
    mask = sparsity.get_sparsity_mask_unstructured(x, None, 50.0)
    np.testing.assert_array_equal(mask, x > 5.5)
    # Values pruned before stay pruned.
    again = sparsity.get_sparsity_mask_unstructured(x, x > 8, 10.0)
    np.testing.assert_array_equal(again, x > 8)
    np.testing.assert_array_equal(
        sparsity.apply_sparsity(x[:4], jnp.array([True, False, True, False]), pruned_value=0.5),
        [1.0, 1.0, 3.0, 2.0],
    )
    np.testing.assert_array_equal(
        sparsity.apply_sparsity(jnp.ones((2, 3)), jnp.array([True, False, True]), True),
        [[1, 0, 1], [1, 0, 1]],
    )


@pytest.mark.parametrize(
    ("kw", "error"),
    [
        ({"n_sparsity": 3, "m_sparsity": 2}, "N <= M"),
        ({"n_sparsity": 1, "m_sparsity": 2, "order": "X"}, "order"),
        ({"n_sparsity": 1, "m_sparsity": 5}, "divisible"),
        ({"n_sparsity": 1, "m_sparsity": 2, "offset": -1}, "offset"),
    ],
)
def test_bad_arguments(kw, error) -> None:
    with pytest.raises(ValueError, match=error):
        sparsity.get_sparsity_mask(jnp.ones((2, 8)), **kw)
