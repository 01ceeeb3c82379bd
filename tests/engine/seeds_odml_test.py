"""The ODML samples of the seeds (Linen and NNX), and the ODML providers' seed-API behaviours."""

import re

import jax
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import qmill.engine as qwix
from qmill.engine.providers import odml
from tests import random_inputs


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(8)(x)))


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(6, 8, rngs=rngs)
        self.linear2 = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


model_input = random_inputs.uniform(jax.random.key(1), (16, 6))
# As the ODML page writes them: no act_static_scale, which the ODML providers take as static.
rules = [qwix.QuantizationRule(weight_qtype="int8", act_qtype="int8")]


def _composites(fn, *args) -> int:
    text = jax.export.export(jax.jit(fn))(*args).mlir_module()
    return len(re.findall(r'stablehlo\.composite "quant\.fake_quant"', text))


def test_linen_sample_act_qtype_alone_is_static_range():
    fp_model = LinenMLP()
    provider = qwix.OdmlQatProvider(rules, strict=True)
    assert provider.rules[0].act_static_scale is True
    qat_model = qwix.quantize_model(fp_model, provider)
    qat_variables = qat_model.init(jax.random.key(0), model_input)
    _, updates = qat_model.apply(qat_variables, model_input, mutable=["quant_stats"])
    params, quant_stats = qat_variables["params"], updates["quant_stats"]
    assert int(quant_stats["Dense_0"]["dot_general0_lhs"]["count"]) == 1
    conversion_provider = qwix.OdmlConversionProvider(rules, params, quant_stats)
    conversion_model = qwix.quantize_model(fp_model, conversion_provider)
    out = conversion_model.apply({"params": params}, model_input)
    # Two weights, two op inputs and the model output, each one composite.
    n = _composites(lambda x: conversion_model.apply({"params": params}, x), model_input)
    assert n == 5
    # The conversion model computes what the QAT model computes (same scales, same codes).
    np.testing.assert_allclose(out, qat_model.apply(qat_variables, model_input), atol=1e-6)
    # An explicit act_static_scale=False stays dynamic, which LiteRT refuses.
    dynamic = [qwix.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=False)]
    with pytest.raises(odml.LiteRtUnsupported, match="static activation scales"):
        qwix.quantize_model(fp_model, qwix.OdmlQatProvider(dynamic)).init(
            jax.random.key(0), model_input
        )


def test_nnx_sample_converts():
    fp_model = NnxMLP(nnx.Rngs(0))
    qat_model = qwix.quantize_model(fp_model, qwix.OdmlQatProvider(rules=rules), model_input)
    qat_out = qat_model(model_input)  # one calibration batch
    params = nnx.to_pure_dict(nnx.state(qat_model, nnx.Param))
    quant_stats = nnx.to_pure_dict(nnx.state(qat_model, qwix.QuantStat))
    conversion_provider = qwix.OdmlConversionProvider(rules, params, quant_stats)
    conversion_model = qwix.quantize_model(fp_model, conversion_provider, model_input)
    graphdef, state = nnx.split(conversion_model)
    fn = lambda params, *args: nnx.merge(graphdef, params)(*args)  # noqa: E731 - the sample's
    assert _composites(fn, state, model_input) == 5
    assert set(conversion_provider.records) == {
        "linear1/kernel",
        "linear1/dot_general0_lhs",
        "linear2/kernel",
        "linear2/dot_general0_lhs",
        odml.MODEL_OUTPUT,
    }
    # QAT ran one batch, after which its statistics are what the conversion uses.
    np.testing.assert_allclose(jax.jit(fn)(state, model_input), qat_out, atol=1e-6)


def test_nnx_conversion_without_collected_stats_raises():
    fp_model = NnxMLP(nnx.Rngs(0))
    qat_model = qwix.quantize_model(fp_model, qwix.OdmlQatProvider(rules=rules), model_input)
    params = nnx.to_pure_dict(nnx.state(qat_model, nnx.Param))
    quant_stats = nnx.to_pure_dict(nnx.state(qat_model, qwix.QuantStat))  # count 0: never run
    provider = qwix.OdmlConversionProvider(rules, params, quant_stats)
    with pytest.raises(ValueError, match=r"linear1/dot_general0_lhs hold no batches"):
        qwix.quantize_model(fp_model, provider, model_input)
    with pytest.raises(ValueError, match=r"no quant_stats for linear1/dot_general0_lhs"):
        qwix.quantize_model(fp_model, qwix.OdmlConversionProvider(rules, params, {}), model_input)


def test_fixed_ranges_for_inputs_and_outputs():
    fp_model = LinenMLP()
    provider = qwix.OdmlQatProvider(
        rules, fixed_range_for_inputs=(0.0, 1.0), fixed_range_for_outputs=(-4.0, 4.0)
    )
    qat_model = qwix.quantize_model(fp_model, provider)
    variables = qat_model.init(jax.random.key(0), model_input)
    _, updates = qat_model.apply(variables, model_input, mutable=["quant_stats"])
    stats = updates["quant_stats"]
    # Whatever the batch, the boundary statistics are the fixed ranges.
    inp = qwix.averaging.calibration(stats[odml.MODEL_INPUT])
    np.testing.assert_array_equal(
        [float(inp["min"].ravel()[0]), float(inp["max"].ravel()[0])], [0.0, 1.0]
    )
    conversion_provider = qwix.OdmlConversionProvider(rules, variables["params"], stats)
    qwix.quantize_model(fp_model, conversion_provider).apply(
        {"params": variables["params"]}, model_input
    )
    records = conversion_provider.records
    assert records[odml.MODEL_INPUT].kind == "input"
    # int8 over [0, 1]: 255 steps; symmetric [-4, 4]: 4 / 127.5 (qmill's symmetric bound).
    np.testing.assert_allclose(records[odml.MODEL_INPUT].scale, [1 / 255], rtol=1e-6)
    np.testing.assert_allclose(records[odml.MODEL_OUTPUT].scale, [4 / 127.5], rtol=1e-6)
    with pytest.raises(ValueError, match="fixed_range_for_inputs"):
        qwix.OdmlQatProvider(rules, fixed_range_for_inputs=(1.0,))


def test_get_interceptors():
    # As the reference: a structural layer, then the numerical one with the ops.
    provider = qwix.OdmlQatProvider(rules)
    interceptors = provider.get_interceptors()
    assert len(interceptors) == 2
    assert "jax.lax.dot_general" in interceptors[1]().mapping
