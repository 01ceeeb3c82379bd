"""QT: the quantized backward pass and the static-range statistics of NNX models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import qmill.engine as qe
from qmill.engine import qarray
from qmill.engine.providers import qt
from tests import random_inputs


class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, use_bias=False)(x)


# Rows of very different magnitudes, so per-row / per-tile scales differ from a per-tensor one.
X = random_inputs.normal(jax.random.key(0), (8, 16)) * jnp.arange(1.0, 9.0)[:, None]
COT = (
    random_inputs.normal(jax.random.key(1), (8, 4)) * jnp.array([1, 9, 2, 7, 3, 8, 1, 5.0])[:, None]
)


def _fq(x, qtype="int8", channelwise=(), tiled=None):
    how = qarray.HowToQuantize(qtype=qtype, channelwise_axes=channelwise, tiled_axes=tiled or {})
    return qarray.dequantize(qarray.quantize(x, how))


def _shifted_dx(w, qtype="int8", per_tensor=False):
    """The lhs gradient as the reference computes it: the weight's scale (per output column, or
    one) moved onto COT, COT quantized per row (or per tensor), times the weight's codes."""
    q = qarray.quantize(
        w, qarray.HowToQuantize(qtype="int8", channelwise_axes=() if per_tensor else (1,))
    )
    g = _fq(COT * q.scale, qtype, channelwise=() if per_tensor else (0,))
    return g @ q.qvalue.T.astype(jnp.float32)


def _grads(rule, rngs=None):
    model = qe.quantize_model(Dense(), qe.QtProvider([rule]))
    params = model.init(jax.random.key(2), X)["params"]

    def loss(params, x):
        return jnp.sum(model.apply({"params": params}, x, rngs=rngs) * COT)

    dw, dx = jax.grad(loss, argnums=(0, 1))(params, X)
    return params["Dense_0"]["kernel"], dw["Dense_0"]["kernel"], dx


def test_bwd_qtype_gradients_equal_the_hand_computed_ones():
    w, dw, dx = _grads(qe.QtRule(weight_qtype="int8", bwd_qtype="int8"))
    # lhs gradient: g per row (its lhs axis) after the weight's scale; weight gradient: g per
    # column (its rhs axis), with the float activation.
    np.testing.assert_allclose(dx, _shifted_dx(w), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dw, X.T @ _fq(COT, channelwise=(1,)), rtol=1e-6, atol=1e-5)
    # ...and really differ from the float-gradient ones, which forward-only QT takes at the
    # operands as given (the reference's use_original_residuals).
    _, dw_float, dx_float = _grads(qe.QtRule(weight_qtype="int8"))
    np.testing.assert_allclose(dx_float, COT @ w.T, rtol=1e-6, atol=1e-6)
    assert not np.allclose(dx, dx_float, atol=1e-4) and not np.allclose(dw, dw_float, atol=1e-4)


def test_bwd_int4_per_tensor_when_channelwise_axes_are_disabled():
    rule = qe.QtRule(weight_qtype="int8", bwd_qtype="int4", disable_channelwise_axes=True)
    w, dw, dx = _grads(rule)
    # Per tensor in the forward pass too: one weight scale moved onto g.
    np.testing.assert_allclose(dx, _shifted_dx(w, "int4", per_tensor=True), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dw, X.T @ _fq(COT, "int4"), rtol=1e-6, atol=1e-5)


def test_weight_gradient_tiles_along_the_batch_axis():
    rule = qe.QtRule(weight_qtype="int8", bwd_qtype="int4", bwd_weight_grad_tile_size=2)
    w, dw, dx = _grads(rule)
    # Only the weight's gradient is tiled: blocks of 2 rows of g share a scale per column.
    np.testing.assert_allclose(
        dw, X.T @ _fq(COT, "int4", channelwise=(1,), tiled={0: 2}), rtol=1e-6, atol=1e-5
    )
    np.testing.assert_allclose(dx, _shifted_dx(w, "int4"), rtol=1e-6, atol=1e-6)
    _, dw_untiled, _ = _grads(qe.QtRule(weight_qtype="int8", bwd_qtype="int4"))
    assert not np.allclose(dw, dw_untiled, atol=1e-4)


def test_stochastic_rounding_noise_is_unbiased_varies_by_key_and_is_reproducible():
    # Values sitting between int8 codes: nearest rounding is biased, stochastic rounding isn't.
    g = jnp.linspace(-3.0, 3.0, 64).reshape(4, 16) + 0.013
    step = float(jnp.max(jnp.abs(g))) / 127.5
    scale = jnp.full((1, 1), step)

    def sr(key, method="uniform"):
        noise = qt.stochastic_noise_fn(method, key, noise_axes=(0, 1))
        q = qarray.quantize_with_scale_zero_point(g, "int8", scale, None, noise)
        return qarray.dequantize(q)

    keys = jax.random.split(jax.random.key(3), 2000)
    for method in ("uniform", "low_bit_uniform"):
        samples = jax.vmap(lambda k, m=method: sr(k, m))(keys)
        nearest_err = float(jnp.abs(_fq(g) - g).mean())
        mean_err = float(jnp.abs(samples.mean(0) - g).mean())
        # 2000 draws: the standard error of a mean of codes is ~ 0.5 / sqrt(2000) of a step.
        assert mean_err < 0.05 * step and mean_err < nearest_err / 4, method
        # Every sample is one of the two codes around the value.
        assert float(jnp.abs(samples - g).max()) <= step * 1.0001
    np.testing.assert_array_equal(sr(keys[0]), sr(keys[0]))
    assert not np.array_equal(sr(keys[0]), sr(keys[1]))


def test_noise_varies_along_the_noise_axes_only():
    noise = qt.stochastic_noise_fn("uniform", jax.random.key(0), noise_axes=(0,))((3, 5))
    assert noise.shape == (3, 5)
    np.testing.assert_array_equal(noise, jnp.broadcast_to(noise[:, :1], (3, 5)))
    assert float(noise.min()) >= -0.5 and float(noise.max()) < 0.5
    with pytest.raises(ValueError, match="uniform"):
        qt.stochastic_noise_fn("gaussian", jax.random.key(0))


def test_stochastic_rounding_of_gradients_through_a_model():
    rule = qe.QtRule(weight_qtype="int8", bwd_qtype="int4", bwd_stochastic_rounding="uniform")
    k1, k2 = jax.random.key(5), jax.random.key(6)
    _, dw1, dx1 = _grads(rule, rngs={"stochastic_rounding": k1})
    _, dw1_again, dx1_again = _grads(rule, rngs={"stochastic_rounding": k1})
    _, dw2, _ = _grads(rule, rngs={"stochastic_rounding": k2})
    np.testing.assert_array_equal(dw1, dw1_again)
    np.testing.assert_array_equal(dx1, dx1_again)
    assert not np.array_equal(dw1, dw2)
    # Without a stream the key comes from the gradient itself: still reproducible.
    _, dw_a, _ = _grads(rule)
    _, dw_b, _ = _grads(rule)
    np.testing.assert_array_equal(dw_a, dw_b)
    _, dw_nearest, _ = _grads(qe.QtRule(weight_qtype="int8", bwd_qtype="int4"))
    assert not np.array_equal(dw_a, dw_nearest)


def test_quantized_backward_under_jit_with_einsum():
    class E(nnx.Module):
        def __init__(self, rngs):
            self.e = nnx.Einsum("btd,dh->bth", (16, 4), rngs=rngs)

        def __call__(self, x):
            return self.e(x)

    x = X.reshape(2, 4, 16)
    rule = qe.QtRule(weight_qtype="int8", bwd_qtype="int8")
    model = qe.quantize_model(E(nnx.Rngs(0)), qe.QtProvider([rule]), x)
    cot = COT.reshape(2, 4, 4)
    dx = nnx.jit(jax.grad(lambda x, m: jnp.sum(m(x) * cot)))(x, model)
    how = qarray.HowToQuantize(qtype="int8", channelwise_axes=(1,))
    q = qarray.quantize(model.e.kernel[...], how)
    # The kernel's scale (per h) moved onto g, g quantized per (b, t), times the kernel's codes.
    g = _fq(cot * q.scale[None], channelwise=(0, 1))
    expected = jnp.einsum("bth,dh->btd", g, q.qvalue.astype(jnp.float32))
    np.testing.assert_allclose(dx, expected, rtol=1e-5, atol=1e-5)


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.linear1 = nnx.Linear(16, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


def test_nnx_quant_stats_accumulate_on_every_call_also_under_jit():
    rules = [qe.QtRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]
    model = qe.quantize_model(NnxMLP(nnx.Rngs(0)), qe.QtProvider(rules), X)
    batches = [X * s for s in (1.0, 2.0, 0.5, 3.0, 1.5)]

    def stat():
        return nnx.to_pure_dict(nnx.state(model, qe.QuantStat))["linear1"]["dot_general0_lhs"]

    assert int(stat()["count"]) == 0  # the initialising call doesn't count
    model(batches[0])
    model(batches[1])
    jitted = nnx.jit(lambda m, x: m(x))
    jitted(model, batches[2])
    jitted(model, batches[3])

    @nnx.jit
    def train_step(m, x):
        return nnx.grad(lambda m: jnp.mean(m(x) ** 2))(m)

    train_step(model, batches[4])
    # Additive statistics: the per-row absmax of each batch, averaged over the batch axis, summed.
    expected = sum(float(jnp.abs(b).max(axis=1).mean()) for b in batches)
    assert int(stat()["count"]) == 5
    np.testing.assert_allclose(stat()["sum_of_absmax"], [[expected]], rtol=1e-5)
    # Frozen for evaluation the way the seeds do it.
    model.set_attributes(disable_quant_stats_update=True, raise_if_not_found=False)
    jitted(model, X)
    assert int(stat()["count"]) == 5
    model.set_attributes(disable_quant_stats_update=False, raise_if_not_found=False)
    jitted(model, X)
    assert int(stat()["count"]) == 6


def test_quantized_backward_of_a_broadcasting_einsum():
    # An operand's size-1 batch axis broadcasts (squeezed before the dot_general it lowers to);
    # the gradients come back in the operands' own shapes, near the float ones.
    class Attention(nn.Module):
        @nn.compact
        def __call__(self, q, k):
            return jnp.einsum("...hqd,bhkd->bhqk", q, k)

    rule = qe.QtRule(weight_qtype="int8", act_qtype="int8", bwd_qtype="int8")
    model = qe.quantize_model(Attention(), qe.QtProvider([rule]))
    q = random_inputs.normal(jax.random.key(3), (1, 4, 8))
    k = random_inputs.normal(jax.random.key(4), (2, 3, 5, 8))

    def grads(apply):
        return jax.jit(jax.grad(lambda q, k: jnp.sum(apply({}, q, k) ** 2), (0, 1)))(q, k)

    got, want = grads(model.apply), grads(Attention().apply)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert 0 < float(jnp.linalg.norm(g - w) / jnp.linalg.norm(w)) < 0.02
