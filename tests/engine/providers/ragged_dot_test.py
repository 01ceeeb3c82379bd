"""jax.lax.ragged_dot (grouped matmul of mixture-of-experts layers) under PTQ and QT."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

import qmill.engine as qe
from qmill.engine import qarray
from tests import random_inputs

GROUPS, K, N = 3, 16, 8
X = random_inputs.normal(jax.random.key(0), (10, K)) * jnp.arange(1.0, 11.0)[:, None]
GROUP_SIZES = jnp.array([4, 5, 1], jnp.int32)


class LinenExperts(nn.Module):
    @nn.compact
    def __call__(self, x, group_sizes):
        w = self.param("w", nn.initializers.lecun_normal(), (GROUPS, K, N))
        return jax.lax.ragged_dot(x, w, group_sizes)


class NnxExperts(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(random_inputs.normal(rngs.params(), (GROUPS, K, N)) * 0.25)

    def __call__(self, x, group_sizes):
        return jax.lax.ragged_dot(x, self.w[...], group_sizes)


def _fq(x, channelwise, tiled=None):
    how = qarray.HowToQuantize(qtype="int8", channelwise_axes=channelwise, tiled_axes=tiled or {})
    return qarray.dequantize(qarray.quantize(x, how))


def test_ptq_linen_stores_expert_weights_quantized_per_group_and_column():
    rules = [qe.QuantizationRule(weight_qtype="int8")]
    fp_params = LinenExperts().init(jax.random.key(1), X, GROUP_SIZES)["params"]
    ptq_model = qe.quantize_model(LinenExperts(), qe.PtqProvider(rules))
    abstract = jax.eval_shape(ptq_model.init, jax.random.key(1), X, GROUP_SIZES)["params"]
    ptq_params = qe.quantize_params(fp_params, abstract)
    w = ptq_params["w"].array
    assert w.qvalue.shape == (GROUPS, K, N) and w.qvalue.dtype == jnp.int8
    assert w.scale.shape == (GROUPS, 1, N)
    out = ptq_model.apply({"params": ptq_params}, X, GROUP_SIZES)
    expected = jax.lax.ragged_dot(X, _fq(fp_params["w"], (0, 2)), GROUP_SIZES)
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    fp_out = LinenExperts().apply({"params": fp_params}, X, GROUP_SIZES)
    np.testing.assert_allclose(out, fp_out, atol=0.05 * float(jnp.abs(fp_out).max()))
    # The init path (float weights fed with mutable=True) quantizes the same way.
    _, variables = ptq_model.apply({"params": fp_params}, X, GROUP_SIZES, mutable=True)
    np.testing.assert_array_equal(variables["params"]["w"].array.qvalue, w.qvalue)


def test_ptq_w8a8_tiled_and_qt_forward_agree():
    rules = [qe.QtRule(weight_qtype="int8", act_qtype="int8", tile_size=8)]
    fp_params = LinenExperts().init(jax.random.key(1), X, GROUP_SIZES)["params"]
    ptq_model = qe.quantize_model(LinenExperts(), qe.PtqProvider(rules))
    _, variables = ptq_model.apply({"params": fp_params}, X, GROUP_SIZES, mutable=True)
    assert variables["params"]["w"].array.scale.shape == (GROUPS, K // 8, N)
    ptq_out = ptq_model.apply(variables, X, GROUP_SIZES)
    fq_x, fq_w = _fq(X, (0,), {1: 8}), _fq(fp_params["w"], (0, 2), {1: 8})
    np.testing.assert_allclose(
        ptq_out, jax.lax.ragged_dot(fq_x, fq_w, GROUP_SIZES), rtol=1e-5, atol=1e-5
    )
    # QT fake-quantizes the same operands; its gradient reaches the expert weights.
    qt_model = qe.quantize_model(LinenExperts(), qe.QtProvider(rules))
    qt_out = qt_model.apply({"params": fp_params}, X, GROUP_SIZES)
    np.testing.assert_allclose(qt_out, ptq_out, rtol=1e-5, atol=1e-5)
    grad = jax.grad(lambda p: jnp.sum(qt_model.apply({"params": p}, X, GROUP_SIZES) ** 2))
    assert float(jnp.abs(grad(fp_params)["w"]).sum(axis=(1, 2)).min()) > 0  # every expert


def test_qt_quantized_backward_of_ragged_dot_under_jit():
    rule = qe.QtRule(weight_qtype="int8", bwd_qtype="int8")
    model = qe.quantize_model(LinenExperts(), qe.QtProvider([rule]))
    params = model.init(jax.random.key(1), X, GROUP_SIZES)["params"]
    cot = random_inputs.normal(jax.random.key(2), (10, N))

    @jax.jit
    def grads(p, x):
        return jax.grad(
            lambda p, x: jnp.sum(model.apply({"params": p}, x, GROUP_SIZES) * cot), (0, 1)
        )(p, x)

    dw, dx = grads(params, X)
    # By hand: the float op's vjp at the fake-quantized weight, fed the quantized cotangent,
    # one scale per row of g for the activation's gradient, per column for the weight's.
    fq_w = _fq(params["w"], (0, 2))
    _, vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, GROUP_SIZES), X, fq_w)
    np.testing.assert_allclose(dx, vjp(_fq(cot, (0,)))[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw["w"], vjp(_fq(cot, (1,)))[1], rtol=1e-5, atol=1e-4)
    assert not np.allclose(dx, vjp(cot)[0], atol=1e-4)


def test_ptq_nnx_ragged_dot_layout():
    rules = [qe.QuantizationRule(weight_qtype="int8")]
    model = NnxExperts(nnx.Rngs(0))
    ptq_model = qe.quantize_model(model, qe.PtqProvider(rules), X, GROUP_SIZES)
    state = nnx.to_pure_dict(nnx.state(ptq_model))
    assert state["w"]["array"]["qvalue"].dtype == jnp.int8
    assert state["w"]["array"]["scale"].shape == (GROUPS, 1, N)
    expected = jax.lax.ragged_dot(X, _fq(model.w[...], (0, 2)), GROUP_SIZES)
    np.testing.assert_allclose(ptq_model(X, GROUP_SIZES), expected, rtol=1e-6, atol=1e-6)
