"""The QT ops with config objects (dot_general_qt / conv_general_qt) and stochastic noise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qmill.engine import qarray
from qmill.engine.core import stochastic_rounding
from qmill.engine.ops import conv_general_qt as conv_qt
from qmill.engine.ops import dot_general_qt as dot_qt
from qmill.engine.providers import qt
from tests import random_inputs

x = random_inputs.normal(jax.random.key(0), (8, 32))
w = random_inputs.normal(jax.random.key(1), (32, 4))
c = random_inputs.normal(jax.random.key(2), (8, 4))  # the output gradient used below
DN = (((1,), (0,)), ((), ()))


def _fq(a, channelwise_axes=(), tiled_axes=None):
    how = qarray.HowToQuantize(
        qtype="int8", channelwise_axes=channelwise_axes, tiled_axes=tiled_axes or {}
    )
    return qarray.dequantize(qarray.quantize(a, how))


def _q(a, channelwise_axes=()):
    return qarray.quantize(a, qarray.HowToQuantize(qtype="int8", channelwise_axes=channelwise_axes))


def _grads(config):
    def loss(a, b):
        return jnp.sum(dot_qt.dot_general_qt(a, b, DN, config) * c)

    return jax.grad(loss, argnums=(0, 1))(x, w)


def test_forward_with_two_dim_weight_scales():
    config = dot_qt.DotGeneralQtConfig(lhs_qtype="int8", rhs_qtype="int8", tile_size=8)
    # The weight gets a scale per (tile of 8 along k, output column): a (4, 4) scale.
    how = qarray.HowToQuantize(qtype="int8", channelwise_axes=(1,), tiled_axes={0: 8})
    assert qarray.quantize(w, how).scale.shape == (4, 4)
    expected = _fq(x, (0,), {1: 8}) @ _fq(w, (1,), {0: 8})
    np.testing.assert_array_equal(dot_qt.dot_general_qt(x, w, DN, config), expected)


def test_backward_straight_through_and_quantized():
    fwd_only = dot_qt.DotGeneralQtConfig(lhs_qtype="int8", rhs_qtype="int8")
    xq, wq = _fq(x, (0,)), _fq(w, (1,))
    dx, dw = _grads(fwd_only)
    # Straight through: the float op's gradients at the fake-quantized operands.
    np.testing.assert_allclose(dx, c @ wq.T, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dw, xq.T @ c, rtol=1e-6, atol=1e-6)
    both = dot_qt.DotGeneralQtConfig(
        lhs_qtype="int8", rhs_qtype="int8", dlhs_grad_qtype="int8", drhs_grad_qtype="int8"
    )
    dx, dw = _grads(both)
    # The other operand's scale moves onto g, which then gets a scale per row (dlhs: its lhs
    # axis) or per column (drhs: its rhs axis); the other operand enters as its codes.
    qx, qw = _q(x, (0,)), _q(w, (1,))
    np.testing.assert_allclose(dx, _fq(c * qw.scale, (0,)) @ qw.qvalue.T, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dw, qx.qvalue.T @ _fq(c * qx.scale, (1,)), rtol=1e-6, atol=1e-6)
    assert not np.allclose(dw, xq.T @ c, rtol=0, atol=1e-7)
    # drhs tiles g along the batch axis it contracts: a scale per (tile of 4 rows, column);
    # tiles under 128 are multiplied dequantized, as the reference.
    tiled = dot_qt.DotGeneralQtConfig(drhs_grad_qtype="int8", drhs_tile_size=4)
    _, dw = _grads(tiled)
    np.testing.assert_allclose(dw, x.T @ _fq(c, (1,), {0: 4}), rtol=1e-6, atol=1e-6)


def test_noise_axes_and_stochastic_rounding_in_the_backward_pass():
    key = jax.random.key(3)
    noise = stochastic_rounding.uniform_noise((3, 5), key=key, channelwise_noise_axes=(1,))
    assert noise.shape == (1, 5) and float(jnp.max(jnp.abs(noise))) <= 0.5
    low = stochastic_rounding.low_bit_uniform_noise((3, 5), key=key, channelwise_noise_axes=(0,))
    assert low.shape == (3, 1)
    np.testing.assert_array_equal(low * 256 % 1, 0)  # 8-bit levels
    fn = qt.stochastic_noise_fn("uniform", key, channelwise_noise_axes=(1,))
    full = fn((3, 5))
    np.testing.assert_array_equal(full, jnp.broadcast_to(noise, (3, 5)))
    # Two keys, two roundings of the same gradient; each is within one step of the nearest one.
    grads = []
    for k in (jax.random.key(4), jax.random.key(5)):
        noisy = qt.stochastic_noise_fn("uniform", k, channelwise_noise_axes=(0, 1))
        config = dot_qt.DotGeneralQtConfig(
            dlhs_grad_qtype="int8", dlhs_stochastic_rounding_noise_fn=noisy
        )
        grads.append(_grads(config)[0])
    assert not np.array_equal(grads[0], grads[1])
    nearest = _fq(c, (0,)) @ w.T
    step = jnp.abs(c).max(axis=1, keepdims=True) / 127.5
    assert bool(jnp.all(jnp.abs(grads[0] - nearest) <= (jnp.abs(w).sum(1).max() * step) + 1e-5))
    with pytest.raises(ValueError, match="stochastic rounding"):
        qt.stochastic_noise_fn("gaussian", key)


def test_conv_general_qt():
    lhs = random_inputs.normal(jax.random.key(6), (2, 3, 6, 6))  # NCHW
    rhs = random_inputs.normal(jax.random.key(7), (4, 3, 3, 3))  # OIHW
    g = random_inputs.normal(jax.random.key(8), (2, 4, 4, 4))
    config = conv_qt.ConvGeneralQtConfig(lhs_qtype="int8", rhs_qtype="int8", drhs_grad_qtype="int8")

    def conv(a, b):
        return jax.lax.conv_general_dilated(a, b, (1, 1), "VALID")

    out, vjp = jax.vjp(
        lambda a, b: conv_qt.conv_general_qt(a, b, config, (1, 1), "VALID"), lhs, rhs
    )
    lq, rq = _fq(lhs, (0,)), _fq(rhs, (0,))
    np.testing.assert_allclose(out, conv(lq, rq), rtol=1e-5, atol=1e-5)  # int8 codes, scaled
    dl, dr = vjp(g)
    _, float_vjp = jax.vjp(conv, lq, rq)
    np.testing.assert_allclose(dl, float_vjp(g)[0], rtol=1e-5, atol=1e-5)  # dlhs: straight
    # drhs: g times the input's scale (per batch item, axis 0), then a scale per output feature
    # (axis 1 of the NCHW output), convolved with the input's codes.
    ql = _q(lhs, (0,))
    _, codes_vjp = jax.vjp(conv, ql.qvalue.astype(jnp.float32), rq)
    expected = codes_vjp(_fq(g * ql.scale, (1,)))[1]
    np.testing.assert_allclose(dr, expected, rtol=1e-5, atol=1e-5)
