"""GPTQ: exact against round-to-nearest when inputs are uncorrelated, better when they are."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qmill.engine import qarray
from qmill.engine.contrib import gptq_core
from tests import random_inputs

ROWS, COLS, SAMPLES = 16, 64, 256
KEYS = jax.random.split(jax.random.key(0), 3)
W = random_inputs.normal(KEYS[0], (ROWS, COLS), jnp.float32)
# Correlated inputs: what GPTQ exploits (RTN ignores the inputs altogether).
MIX = random_inputs.normal(KEYS[1], (COLS, COLS)) / 8 + jnp.eye(COLS)
X = MIX @ random_inputs.normal(KEYS[2], (COLS, SAMPLES))


def _how(qtype="int4", tile=None, method="absmax"):
    tiled = {1: tile} if tile else {}
    return qarray.HowToQuantize(
        qtype=qtype, channelwise_axes=(0,), tiled_axes=tiled, calibration_method=method
    )


def test_identity_hessian_is_round_to_nearest() -> None:
    how = _how("int8")
    q, losses = gptq_core.quantize_weight(W, jnp.eye(COLS), how)
    rtn = qarray.quantize(W, how)
    np.testing.assert_array_equal(q.scale, rtn.scale)
    # Each column is divided by its scale elementwise (the same division as a full-shape scale).
    expected = qarray.quantize_with_scale_zero_point(
        W, "int8", jnp.broadcast_to(rtn.scale, W.shape), None
    )
    np.testing.assert_array_equal(q.qvalue, expected.qvalue)
    assert losses.shape == W.shape


@pytest.mark.parametrize("tile", [None, 16])
def test_correlated_inputs_lower_the_output_error(tile) -> None:
    how = _how("int4", tile)
    q, losses = gptq_core.quantize_weight(W, gptq_core.compute_hessian(X), how, blocksize=32)
    assert q.qvalue.dtype == jnp.int4 and q.scale.shape == (ROWS, COLS // (tile or COLS))
    error = lambda wq: float(jnp.linalg.norm((W - wq) @ X))  # noqa: E731
    gptq_error, rtn_error = (
        error(qarray.dequantize(q)),
        error(qarray.dequantize(qarray.quantize(W, how))),
    )
    # Measured 0.75 (per channel) and 0.74 (groups of 16) of RTN's error on these inputs.
    assert gptq_error < 0.85 * rtn_error
    assert float(losses.sum()) > 0


def test_asymmetric_groups_have_zero_points() -> None:
    q, _ = gptq_core.quantize_weight(W, gptq_core.compute_hessian(X), _how("int8", 32, "minmax"))
    assert q.zero_point is not None and q.zero_point.shape == (ROWS, 2)
    np.testing.assert_allclose(qarray.dequantize(q), W, atol=0.1)


def test_dead_inputs_zero_their_columns() -> None:
    h = gptq_core.compute_hessian(X).at[5, :].set(0.0).at[:, 5].set(0.0)  # input 5 never seen
    q, _ = gptq_core.quantize_weight(W, h, _how("int8"))
    np.testing.assert_array_equal(q.qvalue[:, 5], 0)


def test_normalize_weight_round_trip() -> None:
    w = random_inputs.normal(KEYS[0], (4, 8, 6), jnp.float32)  # contracted axis 1
    flat, restore = gptq_core.normalize_weight(w, 1)
    assert flat.shape == (24, 8)
    np.testing.assert_array_equal(restore(flat), w)
    q, _ = gptq_core.quantize_weight(flat, jnp.eye(8), _how("int8"))
    restored = restore(q)
    assert restored.shape == (4, 8, 6) and restored.scale.shape == (4, 1, 6)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="Hessian shape"):
        gptq_core.quantize_weight(W, jnp.eye(COLS + 1), _how())
    with pytest.raises(ValueError, match="must divide"):
        gptq_core.quantize_weight(W, jnp.eye(COLS), _how(tile=0.3))
