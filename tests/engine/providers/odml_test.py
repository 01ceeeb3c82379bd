"""The ODML providers: composites carrying qmill's scales, statistics of the model output."""

import importlib.util
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import qmill.engine as qe
from qmill.engine.providers import odml, odml_conversion
from tests import digits_data, random_inputs

_spec = importlib.util.spec_from_file_location(
    "qmill_digits_helpers", pathlib.Path(__file__).with_name("digits_test.py")
)
digits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(digits)

W8A8 = [qe.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(8)(x)))


@pytest.fixture(scope="module")
def mlp():
    x = random_inputs.normal(jax.random.key(1), (32, 6))
    return x, MLP().init(jax.random.key(0), x)["params"]


def _calibrate(model, rules, params, batches):
    qat = qe.quantize_model(model, qe.OdmlQatProvider(rules))
    stats = qat.init(jax.random.key(0), batches[0])["quant_stats"]
    for xb in batches:
        _, upd = qat.apply({"params": params, "quant_stats": stats}, xb, mutable=["quant_stats"])
        stats = upd["quant_stats"]
    return stats


def _ptq(model, rules, params, stats, x):
    ptq = qe.quantize_model(model, qe.PtqProvider(rules))
    abstract = jax.eval_shape(ptq.init, jax.random.key(0), x[:1])
    op_stats = {k: v for k, v in stats.items() if k != odml.MODEL_OUTPUT}
    return ptq, qe.quantize_params(params, abstract["params"], op_stats)


def test_qat_records_op_inputs_and_the_model_output(mlp):
    x, params = mlp
    stats = _calibrate(MLP(), W8A8, params, [x[:16], x[16:]])
    assert set(stats) == {"Dense_0", "Dense_1", odml.MODEL_OUTPUT}
    assert int(stats[odml.MODEL_OUTPUT]["count"]) == 2
    # One batch: the output's statistic is the absmax over the batch of the quantized model's
    # output (before the output's own fake quant), which the PTQ model computes too.
    stats = _calibrate(MLP(), W8A8, params, [x])
    ptq, ptq_params = _ptq(MLP(), W8A8, params, stats, x)
    expected = np.abs(ptq.apply({"params": ptq_params}, x)).max()
    got = np.asarray(stats[odml.MODEL_OUTPUT]["sum_of_absmax"]).item()
    np.testing.assert_allclose(got, expected, rtol=1e-4)


def test_qat_refuses_what_litert_cannot_store(mlp):
    x, _ = mlp
    tiled = [qe.QuantizationRule(weight_qtype="int8", tile_size=2)]
    with pytest.raises(odml.LiteRtUnsupported, match="tile_size"):
        qe.quantize_model(MLP(), qe.OdmlQatProvider(tiled)).init(jax.random.key(0), x)
    # act_qtype alone is static-range under the ODML providers; an explicit False is dynamic.
    dynamic = [qe.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=False)]
    with pytest.raises(odml.LiteRtUnsupported, match="act_static_scale"):
        qe.quantize_model(MLP(), qe.OdmlQatProvider(dynamic)).init(jax.random.key(0), x)
    fp8 = [qe.QuantizationRule(weight_qtype="float8_e4m3fn")]
    with pytest.raises(odml.LiteRtUnsupported, match="float8_e4m3fn"):
        qe.quantize_model(MLP(), qe.OdmlQatProvider(fp8)).init(jax.random.key(0), x)


def _exported_text(rules, params, stats, x) -> tuple[str, odml_conversion.OdmlConversionProvider]:
    provider = qe.OdmlConversionProvider(rules, params, stats)
    model = qe.quantize_model(MLP(), provider)
    fn = jax.jit(lambda xb: model.apply({"params": params}, xb))
    exported = jax.export.export(fn, platforms=["cpu"])(jax.ShapeDtypeStruct(x.shape, x.dtype))
    return exported.mlir_module(), provider


def test_conversion_composites_carry_qmills_scales(mlp):
    x, params = mlp
    stats = _calibrate(MLP(), W8A8, params, [x])
    text, provider = _exported_text(W8A8, params, stats, x)
    composites = re.findall(r'stablehlo\.composite "quant\.fake_quant".*', text)
    # Two weights, two op inputs, the model output.
    assert len(composites) == 5
    assert all('dtype = "i8"' in c and "narrow_range = false" in c for c in composites)
    records = provider.records
    assert (
        sorted(r.kind for r in records.values()) == ["activation"] * 2 + ["output"] + ["weight"] * 2
    )
    # Weights: qmill's per-channel int8 values and scales, exactly what quantize_params makes.
    _, ptq_params = _ptq(MLP(), W8A8, params, stats, x)
    for layer in ("Dense_0", "Dense_1"):
        qa = ptq_params[layer]["kernel"].array
        rec = records[f"{layer}/kernel"]
        assert rec.quantization_dimension == 1
        np.testing.assert_array_equal(rec.scale, np.asarray(qa.scale).reshape(-1))
        np.testing.assert_array_equal(rec.qvalue, np.asarray(qa.qvalue))
        # Activations: the static scale the PTQ model computes from the same statistics.
        act = records[f"{layer}/dot_general0_lhs"]
        ptq_scale = ptq_params[layer]["dot_general0_lhs_scale"].array
        np.testing.assert_array_equal(act.scale, np.asarray(ptq_scale).reshape(-1))
        assert act.quantization_dimension == -1 and act.zero_point is None


def test_conversion_model_computes_the_ptq_model(mlp):
    x, params = mlp
    rules = [qe.QuantizationRule(weight_qtype="int8")]
    provider = qe.OdmlConversionProvider(rules, params, None)
    conv = qe.quantize_model(MLP(), provider).apply({"params": params}, x)
    ptq, ptq_params = _ptq(MLP(), rules, params, {}, x)
    np.testing.assert_allclose(conv, ptq.apply({"params": ptq_params}, x), rtol=1e-5, atol=1e-5)


def test_asymmetric_activations_carry_a_zero_point(mlp):
    x, params = mlp
    rules = [
        qe.QuantizationRule(
            weight_qtype="int8",
            act_qtype="int8",
            act_static_scale=True,
            act_calibration_method="minmax",
        )
    ]
    stats = _calibrate(MLP(), rules, params, [x])
    text, provider = _exported_text(rules, params, stats, x)
    rec = provider.records["Dense_0/dot_general0_lhs"]
    assert rec.zero_point is not None
    assert f"zero_point = {rec.zero_point} : i64" in text


def test_conversion_errors_name_the_fix(mlp):
    x, params = mlp
    with pytest.raises(ValueError, match=r"no quant_stats for Dense_\d/dot_general0_lhs"):
        _exported_text(W8A8, params, {}, x)
    tiled = [qe.QuantizationRule(weight_qtype="int4", tile_size=2)]
    with pytest.raises(odml.LiteRtUnsupported, match="tile_size"):
        _exported_text(tiled, params, None, x)
    minmax = [qe.QuantizationRule(weight_qtype="int8", weight_calibration_method="minmax")]
    with pytest.raises(odml.LiteRtUnsupported, match="symmetric"):
        _exported_text(minmax, params, None, x)


def test_digits_cnn_int4_weights_keep_accuracy():
    xs, ys = digits_data.images()[:1300], digits_data.labels()[:1300]
    model = digits.CNN()
    variables = digits._train(
        model, model.init(jax.random.key(0), xs[:1]), xs[:1000], ys[:1000], epochs=4, lr=3e-3
    )
    params = variables["params"]
    rules = [qe.QuantizationRule(weight_qtype="int4")]
    provider = qe.OdmlConversionProvider(rules, params, None)
    logits = jax.jit(lambda x: qe.quantize_model(digits.CNN(), provider).apply(variables, x))(
        xs[1000:]
    )
    float_logits = model.apply(variables, xs[1000:])
    acc = np.mean(np.argmax(logits, -1) == ys[1000:]) * 100
    float_acc = np.mean(np.argmax(float_logits, -1) == ys[1000:]) * 100
    assert float_acc > 90 and acc >= float_acc - 3
    rec = provider.records["Dense_0/kernel"]
    assert rec.qtype == "int4" and rec.qvalue.min() >= -8 and rec.qvalue.max() <= 7
    assert jnp.asarray(rec.scale).shape == (64,)
