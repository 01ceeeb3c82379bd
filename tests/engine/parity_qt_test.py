"""Reference behaviours of quantized training (issue 30): gradient clipping to the calibrated
range, N:M sparsity before quantizing weights, 2-D tiles given as a dict, the QT config's
residual options and its pytree form, and stochastic-rounding noise as a pytree."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import qmill.engine as qwix
from qmill.engine import qconfig
from qmill.engine.core import stochastic_rounding
from qmill.engine.ops import conv_general, conv_general_qt
from qmill.engine.ops import dot_general_qt as dot_qt
from tests import random_inputs
from tests.engine import make_qt_golden as qt_golden

DN = (((1,), (0,)), ((), ()))
# Values outside [-1, 1] at positions 0 and 2: a "fixed,-1,1" calibration clips them.
X_OUT = jnp.array([[-3.0, 0.5, 3.0, 0.25]])


def _dx(config, x, w):
    return jax.grad(lambda a: jnp.sum(dot_qt.dot_general_qt(a, w, DN, config)))(x)


def test_dot_general_qt_masks_gradients_outside_the_calibrated_range():
    w = jnp.ones((4, 1))
    clipped = dot_qt.DotGeneralQtConfig(lhs_qtype="int8", lhs_calibration_method="fixed,-1,1")
    np.testing.assert_array_equal(_dx(clipped, X_OUT, w), [[0.0, 1.0, 0.0, 1.0]])
    # absmax keeps the whole range: nothing is masked; disable_gradient_clipping turns it off.
    absmax = dot_qt.DotGeneralQtConfig(lhs_qtype="int8")
    np.testing.assert_array_equal(_dx(absmax, X_OUT, w), [[1.0, 1.0, 1.0, 1.0]])
    off = dot_qt.DotGeneralQtConfig(
        lhs_qtype="int8", lhs_calibration_method="fixed,-1,1", disable_gradient_clipping=True
    )
    np.testing.assert_array_equal(_dx(off, X_OUT, w), [[1.0, 1.0, 1.0, 1.0]])


def test_use_original_residuals_and_sparsity_rule():
    x = random_inputs.normal(jax.random.key(0), (8, 32))
    w = random_inputs.normal(jax.random.key(1), (32, 4))
    c = random_inputs.normal(jax.random.key(2), (8, 4))

    def dw(config):
        f = lambda b: jnp.sum(dot_qt.dot_general_qt(x, b, DN, config) * c)  # noqa: E731
        return jax.grad(f)(w)

    quantized = dot_qt.DotGeneralQtConfig(lhs_qtype="int8", rhs_qtype="int8")
    original = dot_qt.DotGeneralQtConfig(
        lhs_qtype="int8", rhs_qtype="int8", use_original_residuals=True
    )
    # The weight's gradient reads the lhs residual: the fake-quantized one or x itself.
    np.testing.assert_allclose(dw(original), x.T @ c, rtol=1e-5, atol=1e-5)
    assert not np.allclose(dw(quantized), x.T @ c, rtol=0, atol=1e-5)
    # 2:4 sparsity along the reduction axis ("C") keeps two of four ones: [[2]], not [[4]].
    rule = qconfig.SparsityRule(weight_sparsity_n=2, weight_sparsity_m=4, weight_sparsity_order="C")
    sparse = dot_qt.DotGeneralQtConfig(rhs_qtype="int8", sparsity_rule=rule)
    out = dot_qt.dot_general_qt(jnp.ones((1, 4)), jnp.ones((4, 1)), DN, sparse)
    np.testing.assert_allclose(out, [[2.0]], rtol=1e-2)  # int8 fake quant: 2 · 127 / 127.5


def test_config_and_noise_fn_are_pytrees_through_jit():
    noise = stochastic_rounding.get_noise_fn("uniform", jax.random.key(3), (0,))
    # Drawn along the noise axes only (size 1 elsewhere): it broadcasts where it is added.
    assert noise((2, 3)).shape == (2, 1)
    assert jax.jit(lambda f: f((2, 3)))(noise).shape == (2, 1)
    assert jax.tree.leaves(noise)[0] is noise.key
    # The reference's positional spelling (key, shape) and ours (shape, key=) draw the same.
    key = jax.random.key(4)
    np.testing.assert_array_equal(
        stochastic_rounding.uniform_noise(key, (2, 3)),
        stochastic_rounding.uniform_noise((2, 3), key=key),
    )
    assert stochastic_rounding.low_bit_uniform_noise(key, (2, 3)).shape == (2, 1)
    config = dot_qt.DotGeneralQtConfig(
        lhs_qtype="int8", dlhs_grad_qtype="int8", dlhs_stochastic_rounding_noise_fn=noise
    )
    assert len(jax.tree.leaves(config)) == 1
    x, w = jnp.ones((2, 4)), jnp.ones((4, 3))
    run = jax.jit(lambda cfg, a: dot_qt.dot_general_qt(a, w, DN, cfg))
    np.testing.assert_allclose(run(config, x), x @ w, rtol=1e-2)  # int8: 127 / 127.5
    with pytest.raises(ValueError, match="stochastic rounding"):
        stochastic_rounding.get_noise_fn("gaussian", key)


class LinenDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, use_bias=False)(x)


def _linen_grads(rule, x=X_OUT):
    model = qwix.quantize_model(LinenDense(), qwix.QtProvider([rule]))
    variables = model.init(jax.random.key(0), x)
    return jax.grad(lambda a: jnp.sum(model.apply(variables, a)))(x)


def _nnx_grads(rule, x=X_OUT):
    fp = nnx.Linear(4, 3, use_bias=False, rngs=nnx.Rngs(0))
    model = qwix.quantize_model(fp, qwix.QtProvider([rule]), x)
    return jax.grad(lambda a: jnp.sum(model(a)))(x)


@pytest.mark.parametrize("grads", [_linen_grads, _nnx_grads], ids=["linen", "nnx"])
def test_qt_provider_masks_activation_gradients_outside_the_calibrated_range(grads):
    rule = qwix.QtRule(weight_qtype="int8", act_qtype="int8", act_calibration_method="fixed,-1,1")
    dx = np.asarray(grads(rule))
    assert (dx[0, [0, 2]] == 0).all() and (dx[0, [1, 3]] != 0).all()
    # The reference's override: additional_qt_config={"disable_gradient_clipping": True}.
    off = qwix.QtRule(
        weight_qtype="int8",
        act_qtype="int8",
        act_calibration_method="fixed,-1,1",
        additional_qt_config={"disable_gradient_clipping": True},
    )
    assert (np.asarray(grads(off)) != 0).all()


@pytest.mark.parametrize("tiles", [{0: 2, 1: 3}])
def test_dict_tile_size_reaches_jitted_ops(tiles):
    # A 2-D tile given as a dict: the rule and the HowToQuantize built from it stay hashable.
    rule = qwix.QuantizationRule(weight_qtype="int8", tile_size=tiles)
    assert hash(rule) and rule.tile_size == tiles
    x = jnp.ones((2, 4))
    ptq = qwix.quantize_model(LinenDense(), qwix.PtqProvider([rule]))
    params = jax.jit(ptq.init)(jax.random.key(0), x)["params"]
    kernel = params["Dense_0"]["kernel"].array
    assert kernel.scale.shape == (2, 1)  # (4 / 2, 3 / 3)
    assert jax.jit(ptq.apply)({"params": params}, x).shape == (2, 3)
    qt_rule = qwix.QtRule(weight_qtype="int8", tile_size=tiles)
    qt_model = qwix.quantize_model(LinenDense(), qwix.QtProvider([qt_rule]))
    variables = qt_model.init(jax.random.key(0), x)
    assert jax.jit(qt_model.apply)(variables, x).shape == (2, 3)
    nnx_model = qwix.quantize_model(
        nnx.Linear(4, 3, use_bias=False, rngs=nnx.Rngs(0)), qwix.PtqProvider([rule]), x
    )
    assert nnx_model.kernel.array.scale.shape == (2, 1)
    with pytest.raises(ValueError, match="positive"):
        qwix.QuantizationRule(weight_qtype="int8", tile_size={0: 0})


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_qt_sparsity_rule_prunes_weights_before_quantizing(framework):
    rule = qwix.QtRule(
        weight_qtype="int8",
        sparsity_rule=qconfig.SparsityRule(
            weight_sparsity_n=2, weight_sparsity_m=4, weight_sparsity_order="C"
        ),
    )
    x = jnp.ones((1, 4))

    class One(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1, use_bias=False, kernel_init=nn.initializers.ones)(x)

    if framework == "linen":
        model = qwix.quantize_model(One(), qwix.QtProvider([rule]))
        out = model.apply(model.init(jax.random.key(0), x), x)
    else:
        fp = nnx.Linear(4, 1, use_bias=False, kernel_init=nnx.initializers.ones, rngs=nnx.Rngs(0))
        out = qwix.quantize_model(fp, qwix.QtProvider([rule]), x)(x)
    np.testing.assert_allclose(out, [[2.0]], rtol=1e-2)  # int8 fake quant: 2 · 127 / 127.5


def test_qt_forward_traces_an_integer_dot():
    # As the reference: the quantized operands' codes are multiplied, int8 x int8 -> int32.
    rule = qwix.QtRule(weight_qtype="int8", act_qtype="int8")
    model = qwix.quantize_model(LinenDense(), qwix.QtProvider([rule]))
    x = jnp.ones((2, 4))
    variables = {"params": {"Dense_0": {"kernel": jnp.ones((4, 3))}}}
    products = qt_golden.products(model.apply, (variables, x))
    assert products == {"dot_general int8 x int8 -> int32": 1}


def test_sparsity_rule_through_additional_qt_config_prunes_the_rhs():
    # The reference's case: the provider's dot_general called by a plain module, rhs not a param.
    rule = qwix.QtRule(
        weight_qtype=jnp.int8,
        additional_qt_config={
            "sparsity_rule": qconfig.SparsityRule(weight_sparsity_n=2, weight_sparsity_m=4)
        },
    )
    provider = qwix.QtProvider([rule])

    class Direct(nn.Module):
        def __call__(self, lhs, rhs):
            return provider.dot_general(lhs, rhs, DN)

    out = Direct().apply({}, jnp.ones((1, 4), jnp.bfloat16), jnp.ones((4, 1), jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, [[2.0]])


@pytest.mark.slow
def test_mxfp4_backward_pass_of_attention_with_per_side_overrides():
    rule = qwix.QtRule(
        weight_qtype="mxfp4",
        act_qtype="mxfp4",
        bwd_qtype="mxfp4",
        tile_size=32,
        bwd_weight_grad_tile_size=32,
        additional_qt_config={"dlhs_tile_size": 32, "drhs_tile_size": 32},
    )
    x = jnp.ones((1, 32, 32))
    mha = nnx.MultiHeadAttention(
        num_heads=1, in_features=32, qkv_features=32, out_features=32, rngs=nnx.Rngs(0)
    )
    model = qwix.quantize_model(mha, qwix.QtProvider([rule]), x, decode=False)
    grads = nnx.grad(lambda m, v: jnp.sum(m(v, decode=False)))(model, x)
    leaves = jax.tree.leaves(nnx.to_pure_dict(grads))
    assert leaves and all(bool(jnp.isfinite(g).all()) for g in leaves)


def test_mx_gradient_quantization_infers_the_block():
    # No tile given for an mx gradient qtype: the format's block along the contracted axis.
    x = random_inputs.normal(jax.random.key(0), (32, 64))
    w = random_inputs.normal(jax.random.key(1), (64, 32))
    config = dot_qt.DotGeneralQtConfig(dlhs_grad_qtype="mxfp4", drhs_grad_qtype="mxfp4")
    dx, dw = jax.grad(
        lambda a, b: jnp.sum(dot_qt.dot_general_qt(a, b, DN, config) ** 2), argnums=(0, 1)
    )(x, w)
    assert bool(jnp.isfinite(dx).all()) and bool(jnp.isfinite(dw).all())
    rule = qwix.QtRule(weight_qtype="mxfp4", bwd_qtype="mxfp4")
    model = qwix.quantize_model(nn.Dense(32, use_bias=False), qwix.QtProvider([rule]))
    xs = jnp.ones((32, 32))
    variables = model.init(jax.random.key(0), xs)
    assert jax.grad(lambda a: jnp.sum(model.apply(variables, a)))(xs).shape == (32, 32)


def test_the_reference_gradient_mask_case():
    # Three values, the outer two outside the fixed range: only the middle one has a gradient.
    config = dot_qt.DotGeneralQtConfig(lhs_qtype="int8", lhs_calibration_method="fixed,-1,1")
    dx = _dx(config, jnp.array([[-2.0, 0.5, 2.0]]), jnp.ones((3, 1)))
    np.testing.assert_array_equal(dx, [[0.0, 1.0, 0.0]])


def test_noise_functions_take_shape_then_key_positionally():
    key = jax.random.key(5)
    for noise in (stochastic_rounding.uniform_noise, stochastic_rounding.low_bit_uniform_noise):
        np.testing.assert_array_equal(noise((2, 3), key), noise((2, 3), key=key))
        assert noise((2, 3), key, channelwise_noise_axes=(1,)).shape == (1, 3)


def test_how_to_quantize_with_a_dict_tile_is_a_static_jit_argument():
    how = qwix.qarray.HowToQuantize(qtype="int8", tiled_axes={0: 8, 1: 8})
    assert how == qwix.qarray.HowToQuantize(qtype="int8", tiled_axes={1: 8, 0: 8})
    assert hash(how) == hash(qwix.qarray.HowToQuantize(qtype="int8", tiled_axes={1: 8, 0: 8}))
    x = random_inputs.normal(jax.random.key(0), (16, 24))
    quantize = jax.jit(qwix.qarray.quantize, static_argnums=1)
    q = quantize(x, how)
    assert q.scale.shape == (2, 3)
    np.testing.assert_array_equal(qwix.dequantize(q), qwix.dequantize(qwix.qarray.quantize(x, how)))


def _mae(a, b):
    return float(jnp.abs(a - b).mean() / jnp.abs(a).mean())


def _fake_quant(x, how):
    # The reference test's fake quant (straight-through), written with our public functions.
    calibration = qwix.qarray.calibrate(x, how)
    scale, zero_point = qwix.qarray.compute_scale_zero_point(calibration, how.qtype)
    q = qwix.qarray.quantize_with_scale_zero_point(x, how.qtype, scale, zero_point)
    ste = qwix.qarray.clip_to_calibration(x, calibration, how.tiled_axes)
    return ste + jax.lax.stop_gradient(qwix.dequantize(q) - ste)


def test_int8_conv_backward_nchw_on_the_reference_case():
    # The reference's int8_bwd_nchw case and bounds. The output gradient is multiplied by the
    # other operand's forward scale before it is quantized (per batch item for the input's
    # gradient, per output feature for the kernel's): a sum loss's all-ones gradient then
    # varies, and only each block's largest value sits on the int8 bound (quantizing the ones
    # on their own stored every one as 127 / 127.5: mean error 1/255 = 0.0039).
    dn = ("NCHW", "OIHW", "NCHW")
    lhs = random_inputs.normal(jax.random.key(0), (4, 8, 16, 16))
    rhs = random_inputs.normal(jax.random.key(1), (32, 8, 3, 3))
    dnums = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, dn)
    config = conv_general_qt.ConvGeneralQtConfig(
        lhs_qtype="int8", rhs_qtype="int8", dlhs_grad_qtype="int8", drhs_grad_qtype="int8"
    )

    def conv(a, b):
        return jax.lax.conv_general_dilated(a, b, (1, 1), "SAME", dimension_numbers=dnums)

    def fq_loss(a, b):
        how = functools.partial(conv_general.get_how_to_quantize, dimension_numbers=dnums)
        return jnp.sum(
            conv(
                _fake_quant(a, how(for_lhs=True, qtype="int8")),
                _fake_quant(b, how(for_lhs=False, qtype="int8")),
            )
        )

    def qt_loss(a, b):
        return jnp.sum(
            conv_general_qt.conv_general_qt(a, b, config, (1, 1), "SAME", dimension_numbers=dn)
        )

    grads = jax.jit(lambda f: jax.value_and_grad(f, argnums=(0, 1))(lhs, rhs), static_argnums=0)
    (fq_out, fq_g), (qt_out, qt_g), (fp_out, fp_g) = (
        grads(f) for f in (fq_loss, qt_loss, lambda a, b: jnp.sum(conv(a, b)))
    )
    # The reference's bounds (measured: 6e-8; 0.0020 and 0.0023; 0.0085, 0.0063 and 0.0054).
    assert _mae(fq_out, qt_out) <= 0.002
    assert all(_mae(fq, ours) <= 0.003 for ours, fq in zip(qt_g, fq_g, strict=True))
    assert _mae(fp_out, qt_out) <= 0.009 and _mae(fp_g[1], qt_g[1]) <= 0.02
    assert _mae(fp_g[0], qt_g[0]) <= 0.008


# ---- issue 40: the residual fields of DotGeneralQtConfig ---------------------------------------


def _qt_grads(cfg, lhs, rhs, target=None):
    dn = (((1,), (0,)), ((), ()))

    def loss(a, b):
        out = dot_qt.dot_general_qt(a, b, dn, cfg)
        return jnp.sum(out) if target is None else 0.5 * jnp.sum((out - target) ** 2)

    return jax.grad(loss, argnums=(0, 1))(lhs, rhs)


def test_fp8_backward_configuration_with_residuals():
    # The reference's fp8 backward case: grads and residuals in float8, no forward qtype.
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    lhs = random_inputs.normal(k1, (16, 32))
    rhs = random_inputs.normal(k2, (32, 16))
    target = random_inputs.normal(k3, (16, 16))
    cfg = dot_qt.DotGeneralQtConfig(
        use_original_residuals=False,
        dlhs_grad_qtype=jnp.float8_e4m3fn,
        drhs_grad_qtype=jnp.float8_e4m3fn,
        dlhs_residual_qtype=jnp.float8_e4m3fn,
        drhs_residual_qtype=jnp.float8_e4m3fn,
    )
    ga, gb = _qt_grads(cfg, lhs, rhs, target)
    assert ga.shape == lhs.shape and gb.shape == rhs.shape
    assert not jnp.isnan(ga).any() and not jnp.isnan(gb).any()
    true_ga, true_gb = _qt_grads(dot_qt.DotGeneralQtConfig(), lhs, rhs, target)
    # Close to the float gradients, not equal to them (the residuals are fp8).
    for got, want in ((ga, true_ga), (gb, true_gb)):
        assert 0 < float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 0.1


def test_int8_residuals_quantize_what_the_backward_pass_reads():
    lhs = random_inputs.normal(jax.random.key(1), (8, 32))
    rhs = random_inputs.normal(jax.random.key(2), (32, 4))
    cfg = dot_qt.DotGeneralQtConfig(
        lhs_qtype="int8",
        rhs_qtype="int8",
        use_original_residuals=True,
        dlhs_residual_qtype="int8",
        drhs_residual_qtype="int8",
    )
    ga, gb = _qt_grads(cfg, lhs, rhs)

    def fq(x, axis):  # one scale per index of the axis the backward dot keeps
        how = qwix.HowToQuantize(qtype="int8", channelwise_axes=(axis,))
        return qwix.qarray.dequantize(qwix.qarray.quantize(x, how))

    g = jnp.ones((8, 4))
    np.testing.assert_allclose(ga, g @ fq(rhs, 0).T, rtol=1e-6)
    np.testing.assert_allclose(gb, fq(lhs, 1).T @ g, rtol=1e-6)
    # Where the backward pass already reads the quantized operands, residual fields change
    # nothing (as the reference: they apply to residuals not quantized yet).
    plain = dot_qt.DotGeneralQtConfig(lhs_qtype="int8", rhs_qtype="int8")
    with_fields = dot_qt.DotGeneralQtConfig(
        lhs_qtype="int8", rhs_qtype="int8", dlhs_residual_qtype="int8", drhs_residual_qtype="int8"
    )
    for a, b in zip(_qt_grads(plain, lhs, rhs), _qt_grads(with_fields, lhs, rhs), strict=True):
        np.testing.assert_array_equal(a, b)


def test_dot_general_qt_fwd_bwd_takes_the_calibrations():
    # The reference's custom-VJP entry: with each side's own calibration, dot_general_qt.
    lhs = random_inputs.normal(jax.random.key(1), (8, 32))
    rhs = random_inputs.normal(jax.random.key(2), (32, 4))
    dn = (((1,), (0,)), ((), ()))
    cfg = dot_qt.DotGeneralQtConfig(
        lhs_qtype="int8", rhs_qtype="int8", dlhs_grad_qtype="int8", drhs_grad_qtype="int8"
    )

    def how(for_lhs):
        return qwix.ops.dot_general.get_how_to_quantize(
            dimension_numbers=dn, ndims=(2, 2), for_lhs=for_lhs, qtype="int8"
        )

    cals = (qwix.qarray.calibrate(lhs, how(True)), qwix.qarray.calibrate(rhs, how(False)))

    def given(a, b):
        return jnp.sum(dot_qt.dot_general_qt_fwd_bwd(a, b, *cals, dn, cfg) ** 2)

    def own(a, b):
        return jnp.sum(dot_qt.dot_general_qt(a, b, dn, cfg) ** 2)

    np.testing.assert_array_equal(
        dot_qt.dot_general_qt_fwd_bwd(lhs, rhs, *cals, dn, cfg),
        dot_qt.dot_general_qt(lhs, rhs, dn, cfg),
    )
    for a, b in zip(
        jax.grad(given, (0, 1))(lhs, rhs), jax.grad(own, (0, 1))(lhs, rhs), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    # None: that side stays float.
    out = dot_qt.dot_general_qt_fwd_bwd(lhs, rhs, None, None, dn, cfg)
    np.testing.assert_allclose(out, lhs @ rhs, rtol=1e-5)


def test_quantize_linen_model_is_quantize_models_linen_half():
    model = qwix.model.quantize_linen_model(
        nn.Dense(4), qwix.PtqProvider([qwix.QuantizationRule(weight_qtype="int8")]), ["__call__"]
    )
    x = jnp.ones((2, 8))
    params = model.init(jax.random.key(0), x)["params"]
    assert isinstance(params["kernel"], qwix.WithAux)
    assert model.apply({"params": params}, x).shape == (2, 4)


def test_a_config_with_a_2d_tile_size_is_a_static_jit_argument():
    cfg = dot_qt.DotGeneralQtConfig(
        lhs_qtype="int8",
        rhs_qtype="int8",
        tile_size={0: 2, 1: 2},
        dlhs_grad_qtype="int8",
        drhs_grad_qtype="int8",
    )
    dn = (((1,), (0,)), ((), ()))
    lhs, rhs = jnp.ones((4, 8)), jnp.ones((8, 4))
    loss = lambda a, b, c: jnp.sum(dot_qt.dot_general_qt(a, b, dn, c))  # noqa: E731
    grad = jax.jit(jax.grad(loss), static_argnums=2)
    np.testing.assert_array_equal(grad(lhs, rhs, cfg), jax.grad(loss)(lhs, rhs, cfg))
    same = dataclasses.replace(cfg, tile_size={1: 2, 0: 2})
    assert hash(same) == hash(cfg) and same == cfg
