"""ops.ragged_dot (the core op) and ops.ragged_dot_qt (quantized backward) vs jax.lax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qmill.engine import ops, qarray
from tests import random_inputs

M, K, N = 10, 16, 8
KEYS = jax.random.split(jax.random.key(0), 3)
X = random_inputs.normal(KEYS[0], (M, K), jnp.float32)
W = random_inputs.normal(KEYS[1], (3, K, N), jnp.float32)
CT = random_inputs.normal(KEYS[2], (M, N), jnp.float32)  # cotangent of the output
GROUPS = jnp.array([4, 5, 1], jnp.int32)
# f32 sums of the same products in another order (and int32 sums then two scale multiplies):
# a few ulps of values up to ~30.
TOL = {"rtol": 1e-5, "atol": 1e-4}


def _q(x, qtype, channelwise, tiled=None):
    how = qarray.HowToQuantize(qtype=qtype, channelwise_axes=channelwise, tiled_axes=tiled or {})
    return qarray.quantize(x, how)


@pytest.mark.parametrize("qtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("rhs_channelwise", [(0, 2), (2,)])
def test_native_path_matches_dequantized(qtype, rhs_channelwise) -> None:
    how = ops.ragged_dot.get_how_to_quantize(for_lhs=True, qtype=qtype)
    ql = qarray.quantize(X, how)
    qr = _q(W, qtype, rhs_channelwise)
    out = ops.ragged_dot.ragged_dot(ql, qr, GROUPS)
    expected = jax.lax.ragged_dot(qarray.dequantize(ql), qarray.dequantize(qr), GROUPS)
    np.testing.assert_allclose(out, expected, **TOL)
    assert out.dtype == jnp.float32
    hlo = jax.jit(ops.ragged_dot.ragged_dot).lower(ql, qr, GROUPS).as_text()
    stored = "i8" if qtype == "int8" else "f8E4M3FN"
    assert f"x{stored}>" in hlo  # codes reach the matmul, not dequantized values


def test_get_how_to_quantize_layouts() -> None:
    lhs = ops.ragged_dot.get_how_to_quantize(for_lhs=True, qtype="int8")
    rhs = ops.ragged_dot.get_how_to_quantize(for_lhs=False, qtype="int4", tile_size=8)
    assert lhs.channelwise_axes == (0,) and rhs.channelwise_axes == (0, 2)
    assert rhs.tiled_axes_dict == {1: 8}


def test_fallbacks_dequantize_or_promote() -> None:
    # A sub-channel (tiled k) weight can't be scaled after the matmul: dequantized first.
    qr = _q(W, "int4", (0, 2), {1: 8})
    out = ops.ragged_dot.ragged_dot(X, qr, GROUPS)
    np.testing.assert_array_equal(out, jax.lax.ragged_dot(X, qarray.dequantize(qr), GROUPS))
    codes = jnp.full((M, K), 100, jnp.int8)
    out = ops.ragged_dot.ragged_dot(codes, jnp.full((3, K, N), 100, jnp.int8), GROUPS)
    assert out.dtype == jnp.int32 and int(out[0, 0]) == K * 100 * 100
    mixed = ops.ragged_dot.ragged_dot(codes, W, GROUPS)
    np.testing.assert_array_equal(mixed, jax.lax.ragged_dot(codes.astype(jnp.float32), W, GROUPS))


def _grads(fn):
    return jax.jit(jax.grad(lambda a, b: jnp.sum(fn(a, b) * CT), argnums=(0, 1)))(X, W)


def test_qt_without_quantization_is_ragged_dot() -> None:
    config = ops.ragged_dot_qt.RaggedDotQtConfig()
    got = _grads(lambda a, b: ops.ragged_dot_qt.ragged_dot_qt(a, b, GROUPS, config))
    want = _grads(lambda a, b: jax.lax.ragged_dot(a, b, GROUPS))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, **TOL)


def test_qt_forward_quantized_backward_straight_through() -> None:
    config = ops.ragged_dot_qt.RaggedDotQtConfig(lhs_qtype="int8", rhs_qtype="int8")
    fx = qarray.dequantize(_q(X, "int8", (0,)))
    fw = qarray.dequantize(_q(W, "int8", (2,)))
    out = ops.ragged_dot_qt.ragged_dot_qt(X, W, GROUPS, config)
    np.testing.assert_allclose(out, jax.lax.ragged_dot(fx, fw, GROUPS), **TOL)
    dlhs, drhs = _grads(lambda a, b: ops.ragged_dot_qt.ragged_dot_qt(a, b, GROUPS, config))
    # Straight through: the gradients of the float op at the fake-quantized operands.
    want_l, want_r = jax.grad(
        lambda a, b: jnp.sum(jax.lax.ragged_dot(a, b, GROUPS) * CT), argnums=(0, 1)
    )(fx, fw)
    np.testing.assert_allclose(dlhs, want_l, **TOL)
    np.testing.assert_allclose(drhs, want_r, **TOL)


def test_qt_quantized_gradients() -> None:
    config = ops.ragged_dot_qt.RaggedDotQtConfig(
        lhs_qtype="int8", rhs_qtype="int8", dlhs_grad_qtype="int8", drhs_grad_qtype="int8"
    )
    ql, qr = _q(X, "int8", (0,)), _q(W, "int8", (2,))
    dlhs, drhs = _grads(lambda a, b: ops.ragged_dot_qt.ragged_dot_qt(a, b, GROUPS, config))
    # dlhs: the gradient times rhs's column scale, quantized per row, times rhs's codes.
    g_l = qarray.dequantize(_q(CT * qr.scale[:, 0, :], "int8", (0,)))
    codes_t = jnp.swapaxes(qr.qvalue.astype(jnp.float32), 1, 2)
    np.testing.assert_allclose(dlhs, jax.lax.ragged_dot(g_l, codes_t, GROUPS), **TOL)
    # drhs: lhs's codes against the gradient times lhs's row scale, quantized per column.
    g_r = qarray.dequantize(_q(CT * ql.scale, "int8", (1,)))
    codes = ql.qvalue.astype(jnp.float32)
    want = jnp.stack([codes[s:e].T @ g_r[s:e] for s, e in [(0, 4), (4, 9), (9, 10)]])
    np.testing.assert_allclose(drhs, want, **TOL)
    # And both stay close to the float gradients (int8 on both sides, |g| ~ 10).
    float_l, float_r = _grads(lambda a, b: jax.lax.ragged_dot(a, b, GROUPS))
    assert float(jnp.max(jnp.abs(dlhs - float_l))) < 0.03 * float(jnp.max(jnp.abs(float_l)))
    assert float(jnp.max(jnp.abs(drhs - float_r))) < 0.03 * float(jnp.max(jnp.abs(float_r)))


def test_ragged_dot_general_takes_qarrays() -> None:
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    ql = _q(X, "int8", (0,))
    out = ops.ragged_dot.ragged_dot_general(ql, CT, GROUPS, dims)
    expected = jax.lax.ragged_dot_general(qarray.dequantize(ql), CT, GROUPS, dims)
    assert out.shape == (3, K, N)
    np.testing.assert_array_equal(out, expected)
