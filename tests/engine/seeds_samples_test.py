"""The seeds' code samples (get started, PTQ/SRQ, QT, ODML) with only the import line changed.

``import qwix`` becomes ``import qmill.engine as qwix`` and ``from qwix import qconfig`` becomes
``from qmill.engine import qconfig``; everything else is written as the samples write it,
providers taking ``rules`` by keyword where the reference's signature allows it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qmill.engine as qwix
from qmill.engine import qconfig
from tests import random_inputs
from tests.engine.seed_models import LinenMLP, NnxMLP

model_input = random_inputs.uniform(jax.random.key(0), (8, 16))
SRQ = [qconfig.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]


def test_providers_take_rules_by_keyword():
    rules = [qwix.QuantizationRule(module_path=".*", weight_qtype="int8", act_qtype="int8")]
    for provider in (
        qwix.PtqProvider(rules=rules),
        qwix.QtProvider(rules=rules),
        qwix.OdmlQatProvider(rules=rules, strict=True),
        qwix.OdmlConversionProvider(rules=rules, params={}, quant_stats={}),
    ):
        assert len(provider.rules) == 1
    with pytest.raises(TypeError, match="wrap the rule"):
        qwix.PtqProvider(rules=rules[0])


def test_get_started_linen_and_nnx_with_keyword_rules():
    rules = [qwix.QuantizationRule(module_path=".*", weight_qtype="int8", act_qtype="int8")]
    ptq_model = qwix.quantize_model(LinenMLP(64, 16), qwix.PtqProvider(rules=rules))
    params = jax.eval_shape(ptq_model.init, jax.random.key(0), model_input)["params"]
    assert params["Dense_0"]["kernel"].array.qvalue.shape == (16, 64)
    assert params["Dense_1"]["kernel"].array.scale.shape == (1, 16)
    model = NnxMLP(16, 64, 16, rngs=nnx.Rngs(0))
    ptq_model = qwix.quantize_model(model, qwix.PtqProvider(rules=rules), model_input)
    state = jax.eval_shape(nnx.to_pure_dict, nnx.state(ptq_model))
    assert state["linear1"]["kernel"]["array"]["qvalue"].dtype == jnp.int8
    assert state["linear2"]["kernel"]["array"]["scale"].shape == (1, 16)


def test_srq_nnx_with_qconfig_rules():
    model = NnxMLP(16, 64, 16, rngs=nnx.Rngs(0))
    qt_model = qwix.quantize_model(model, qwix.QtProvider(rules=SRQ), model_input)
    qt_out = qt_model(model_input)  # one calibration batch
    ptq_model = qwix.quantize_model(qt_model, qwix.PtqProvider(rules=SRQ), model_input)
    ptq_params = qwix.quantize_params(
        nnx.to_pure_dict(nnx.state(qt_model, nnx.Param)),
        ptq_model,
        nnx.to_pure_dict(nnx.state(qt_model, qwix.QuantStat)),
    )
    scale = ptq_params["linear1"]["dot_general0_lhs_scale"]["array"]
    # The statistic of the one batch: per-row absmax averaged over the batch, over int8's bound.
    np.testing.assert_allclose(scale, [[jnp.abs(model_input).max(axis=1).mean() / 127.5]], 1e-6)
    # The PTQ model's static scale is exactly QT's, so the outputs agree to float rounding.
    np.testing.assert_allclose(ptq_model(model_input), qt_out, atol=1e-5)


def test_uncalibrated_nnx_qt_model_is_refused_by_ptq_not_given_scale_one():
    model = NnxMLP(16, 64, 16, rngs=nnx.Rngs(0))
    qt_model = qwix.quantize_model(model, qwix.QtProvider(rules=SRQ), model_input)
    with pytest.raises(ValueError, match=r"linear1/dot_general0_lhs were never collected"):
        qwix.quantize_model(qt_model, qwix.PtqProvider(rules=SRQ), model_input)


def test_uncalibrated_linen_stats_are_refused_by_quantize_params_and_odml():
    model = LinenMLP(64, 16)
    qt_variables = qwix.quantize_model(model, qwix.QtProvider(rules=SRQ)).init(
        jax.random.key(0), model_input
    )
    ptq_model = qwix.quantize_model(model, qwix.PtqProvider(rules=SRQ))
    abs_vars = jax.eval_shape(ptq_model.init, jax.random.key(0), model_input)
    with pytest.raises(ValueError, match=r"Dense_0/dot_general0_lhs hold no batches"):
        qwix.quantize_params(
            qt_variables["params"], abs_vars["params"], qt_variables["quant_stats"]
        )
    provider = qwix.OdmlConversionProvider(SRQ, qt_variables["params"], qt_variables["quant_stats"])
    conversion_model = qwix.quantize_model(model, provider)
    with pytest.raises(ValueError, match=r"Dense_0/dot_general0_lhs hold no batches"):
        conversion_model.apply({"params": qt_variables["params"]}, model_input)


def test_qt_sample_linen_and_nnx():
    qt_rules = [qwix.QtRule(weight_qtype="int8", act_qtype="int8", bwd_qtype="int8")]
    qat_rules = [qwix.QuantizationRule(weight_qtype="int8", act_qtype="int8")]
    fp_model = LinenMLP(64, 16)
    params = fp_model.init(jax.random.key(1), model_input)["params"]
    qt_model = qwix.quantize_model(fp_model, qwix.QtProvider(qt_rules))
    qat_model = qwix.quantize_model(fp_model, qwix.QtProvider(qat_rules))

    def loss(m, p):
        return jnp.sum(m.apply({"params": p}, model_input) ** 2)

    # Same forward pass; only QT quantizes the gradients.
    np.testing.assert_array_equal(
        qt_model.apply({"params": params}, model_input),
        qat_model.apply({"params": params}, model_input),
    )
    g_qt, g_qat = (
        jax.grad(lambda p: loss(qt_model, p))(params),
        jax.grad(lambda p: loss(qat_model, p))(params),
    )
    assert not np.array_equal(g_qt["Dense_0"]["kernel"], g_qat["Dense_0"]["kernel"])
    # Static range: the statistics' layout the sample prints.
    rules = [qwix.QtRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]
    stats = qwix.quantize_model(fp_model, qwix.QtProvider(rules)).init(
        jax.random.key(0), model_input
    )["quant_stats"]
    assert jax.tree.map(lambda a: (a.shape, str(a.dtype)), stats) == {
        layer: {"dot_general0_lhs": {"count": ((), "int32"), "sum_of_absmax": ((1, 1), "float32")}}
        for layer in ("Dense_0", "Dense_1")
    }
    nnx_qt = qwix.quantize_model(
        NnxMLP(16, 64, 16, rngs=nnx.Rngs(0)), qwix.QtProvider(rules), model_input
    )
    stat = nnx_qt.linear1.dot_general0_lhs
    assert isinstance(stat, qwix.QuantStat) and int(stat.get_value()["count"]) == 0


def _shapes(tree):
    return jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), tree)


def test_lora_sample_linen_and_nnx():
    rules = [qwix.LoraRule(weight_qtype="nf4", rank=16, alpha=0.5)]
    lora_model = qwix.apply_lora_to_model(LinenMLP(64, 16), qwix.LoraProvider(rules=rules))
    params = jax.eval_shape(lora_model.init, jax.random.key(0), model_input)["params"]
    # The sample's printout: nf4 codes (uint4 storage) with per-column scales, and adapters.
    kernel = params["Dense_0"]["kernel"].array
    assert kernel.qtype == "nf4" and _shapes((kernel.qvalue, kernel.scale)) == (
        ((16, 64), "uint4"),
        ((1, 64), "float32"),
    )
    assert _shapes({k: v for k, v in params["Dense_1"].items() if k != "kernel"}) == {
        "kernel_lora_a": ((64, 16), "float32"),
        "kernel_lora_b": ((16, 16), "float32"),
    }
    model = NnxMLP(16, 64, 16, rngs=nnx.Rngs(0))
    lora_model = qwix.apply_lora_to_model(model, qwix.LoraProvider(rules=rules), model_input)
    assert _shapes(jax.eval_shape(nnx.to_pure_dict, nnx.state(lora_model))) == {
        "linear1": {
            "kernel": {"array": {"qvalue": ((16, 64), "uint4"), "scale": ((1, 64), "float32")}},
            "kernel_lora_a": ((16, 16), "float32"),
            "kernel_lora_b": ((16, 64), "float32"),
        },
        "linear2": {
            "kernel": {"array": {"qvalue": ((64, 16), "uint4"), "scale": ((1, 16), "float32")}},
            "kernel_lora_a": ((64, 16), "float32"),
            "kernel_lora_b": ((16, 16), "float32"),
        },
    }


def test_quantize_model_rngs_initialise_lora_adapters():
    rules = [qwix.LoraRule(rank=4, alpha=1.0)]

    def adapter(seed):
        model = NnxMLP(16, 64, 16, rngs=nnx.Rngs(0))
        provider = qwix.LoraProvider(rules=rules)
        lora = qwix.quantize_model(model, provider, model_input, rngs=nnx.Rngs(seed))
        return np.asarray(lora.linear1.kernel_lora_a[...])

    np.testing.assert_array_equal(adapter(1), adapter(1))
    assert not np.array_equal(adapter(1), adapter(2))
    with pytest.raises(ValueError, match=r"rngs= must be an nnx\.Rngs"):
        qwix.quantize_model(
            NnxMLP(16, 64, 16, rngs=nnx.Rngs(0)), qwix.PtqProvider(rules=SRQ), model_input, rngs=1
        )
