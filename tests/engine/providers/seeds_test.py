"""The code samples of seeds 003 (get started) and 004 (PTQ docs), run against qmill.engine."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qmill.engine as qwix  # the samples are written against `qwix`; only the import changes
from qmill.engine import qconfig
from tests import random_inputs
from tests.engine.seed_models import LinenMLP, NnxMLP

MODEL_INPUT = random_inputs.uniform(jax.random.key(0), (8, 16))
RULES = [qwix.QuantizationRule(module_path=".*", weight_qtype="int8", act_qtype="int8")]


def _shapes(tree):
    return jax.tree.map(lambda a: (tuple(a.shape), np.dtype(a.dtype).name), tree)


def test_get_started_linen_layout():
    ptq_model = qwix.quantize_model(LinenMLP(64, 16), qwix.PtqProvider(RULES))
    params = jax.eval_shape(ptq_model.init, jax.random.key(0), MODEL_INPUT)["params"]
    kernel = params["Dense_0"]["kernel"]
    assert isinstance(kernel, qwix.WithAux)
    assert kernel.array.qvalue.shape == (16, 64) and kernel.array.qvalue.dtype == jnp.int8
    assert kernel.array.scale.shape == (1, 64) and kernel.array.scale.dtype == jnp.float32
    assert params["Dense_1"]["kernel"].array.scale.shape == (1, 16)


def test_get_started_nnx_layout():
    model = NnxMLP(16, 64, 16, rngs=nnx.Rngs(0))
    ptq_model = qwix.quantize_model(model, qwix.PtqProvider(RULES), MODEL_INPUT)
    state = jax.eval_shape(nnx.to_pure_dict, nnx.state(ptq_model))
    assert _shapes(state) == {
        "linear1": {
            "kernel": {"array": {"qvalue": ((16, 64), "int8"), "scale": ((1, 64), "float32")}}
        },
        "linear2": {
            "kernel": {"array": {"qvalue": ((64, 16), "int8"), "scale": ((1, 16), "float32")}}
        },
    }
    # The float model is left as it was, and the quantized one computes nearly the same thing.
    assert isinstance(model.linear1.kernel, nnx.Param)
    np.testing.assert_allclose(ptq_model(MODEL_INPUT), model(MODEL_INPUT), atol=0.05)


def test_ptq_linen_quantize_params_matches_init_path():
    fp_model = LinenMLP(64, 16)
    fp_params = fp_model.init(jax.random.key(1), MODEL_INPUT)["params"]
    ptq_model = qwix.quantize_model(fp_model, qwix.PtqProvider(RULES))
    abs_ptq_variables = jax.eval_shape(ptq_model.init, jax.random.key(0), MODEL_INPUT)
    ptq_params = qwix.quantize_params(fp_params, abs_ptq_variables["params"])
    quantized_model_output = ptq_model.apply({"params": ptq_params}, MODEL_INPUT)
    # Alternative way: feed float weights to the PTQ model with mutable=True.
    out, ptq_variables = ptq_model.apply({"params": fp_params}, MODEL_INPUT, mutable=True)
    np.testing.assert_array_equal(out, quantized_model_output)
    a = ptq_variables["params"]["Dense_0"]["kernel"].array
    b = ptq_params["Dense_0"]["kernel"].array
    np.testing.assert_array_equal(a.qvalue, b.qvalue)
    np.testing.assert_allclose(
        quantized_model_output, fp_model.apply({"params": fp_params}, MODEL_INPUT), atol=0.05
    )


def test_ptq_linen_refuses_float_params_without_mutable():
    fp_model = LinenMLP(64, 16)
    fp_variables = fp_model.init(jax.random.key(1), MODEL_INPUT)
    ptq_model = qwix.quantize_model(fp_model, qwix.PtqProvider(RULES))
    with pytest.raises(ValueError, match="quantize_params"):
        ptq_model.apply(fp_variables, MODEL_INPUT)


def test_ptq_nnx_eval_shape_and_layer_by_layer_quantize_params():
    # w8a8: activations are quantized too, with the concrete MODEL_INPUT met inside nnx.jit.
    def create_quantized_model():
        fp_model = NnxMLP(16, 64, 16, rngs=nnx.Rngs(0))
        return qwix.quantize_model(fp_model, qwix.PtqProvider(RULES), MODEL_INPUT)

    jit_model = nnx.jit(create_quantized_model)()
    fp_params = nnx.to_pure_dict(nnx.state(NnxMLP(16, 64, 16, rngs=nnx.Rngs(0)), nnx.Param))
    abs_ptq_model = nnx.eval_shape(create_quantized_model)
    # Abstract: no float (or quantized) weight is materialised.
    leaves = jax.tree.leaves(nnx.state(abs_ptq_model))
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    # Pipelined loading: one layer at a time.
    for layer in ("linear1", "linear2"):
        ptq_params = qwix.quantize_params({layer: fp_params[layer]}, abs_ptq_model)
        nnx.update(abs_ptq_model, ptq_params)
    # Same codes up to XLA's fused division under jit: outputs agree to float rounding.
    np.testing.assert_allclose(abs_ptq_model(MODEL_INPUT), jit_model(MODEL_INPUT), atol=2e-2)
    # Both quantize activations: they differ from the weight-only model's output.
    weight_only = qwix.quantize_model(
        NnxMLP(16, 64, 16, rngs=nnx.Rngs(0)),
        qwix.PtqProvider([qwix.QuantizationRule(weight_qtype="int8")]),
        MODEL_INPUT,
    )
    assert not np.allclose(jit_model(MODEL_INPUT), weight_only(MODEL_INPUT), atol=1e-6)


def test_quantize_params_extra_params():
    ptq_model = qwix.quantize_model(LinenMLP(64, 16), qwix.PtqProvider(RULES))
    abs_params = jax.eval_shape(ptq_model.init, jax.random.key(0), MODEL_INPUT)["params"]
    params = LinenMLP(64, 16).init(jax.random.key(0), MODEL_INPUT)["params"]
    params = {**params, "loss_head": {"w": jnp.ones((3,))}}
    with pytest.raises(ValueError, match="allow_extra_params"):
        qwix.quantize_params(params, abs_params)
    out = qwix.quantize_params(params, abs_params, allow_extra_params=True)
    assert "loss_head" not in out


def test_srq_linen():
    model = LinenMLP(64, 16)
    rules = [
        qconfig.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True),
    ]
    qt_model = qwix.quantize_model(model, qwix.QtProvider(rules))
    qt_variables = qt_model.init(jax.random.key(0), MODEL_INPUT)
    assert set(qt_variables) == {"params", "quant_stats"}
    _, updates = qt_model.apply(qt_variables, MODEL_INPUT, mutable=["quant_stats"])
    qt_variables = {**qt_variables, **updates}
    ptq_model = qwix.quantize_model(model, qwix.PtqProvider(rules))
    abs_ptq_variables = jax.eval_shape(ptq_model.init, jax.random.key(0), MODEL_INPUT)
    ptq_params = qwix.quantize_params(
        qt_variables["params"], abs_ptq_variables["params"], qt_variables["quant_stats"]
    )
    scale = ptq_params["Dense_0"]["dot_general0_lhs_scale"].array
    # Per-row absmax (rows are the lhs channels), averaged over the batch axis, over int8's bound.
    expected = jnp.abs(MODEL_INPUT).max(axis=1).mean() / 127.5
    np.testing.assert_allclose(scale, [[expected]], rtol=1e-6)
    qt_out = qt_model.apply(qt_variables, MODEL_INPUT)
    np.testing.assert_allclose(
        ptq_model.apply({"params": ptq_params}, MODEL_INPUT), qt_out, atol=1e-5
    )


def test_srq_linen_uninitialised_stats_refused():
    rules = [qconfig.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]
    qt_model = qwix.quantize_model(LinenMLP(64, 16), qwix.QtProvider(rules))
    qt_variables = qt_model.init(jax.random.key(0), MODEL_INPUT)
    ptq_model = qwix.quantize_model(LinenMLP(64, 16), qwix.PtqProvider(rules))
    abs_vars = jax.eval_shape(ptq_model.init, jax.random.key(0), MODEL_INPUT)
    with pytest.raises(ValueError, match="count 0"):
        qwix.quantize_params(
            qt_variables["params"], abs_vars["params"], qt_variables["quant_stats"]
        )


def test_srq_nnx():
    model = NnxMLP(16, 64, 16, rngs=nnx.Rngs(0))
    rules = [
        qconfig.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True),
    ]
    qt_model = qwix.quantize_model(model, qwix.QtProvider(rules), MODEL_INPUT)
    stats = nnx.to_pure_dict(nnx.state(qt_model, qwix.QuantStat))
    assert int(stats["linear1"]["dot_general0_lhs"]["count"]) == 0
    qt_out = qt_model(MODEL_INPUT)  # one calibration batch
    ptq_params = qwix.quantize_params(
        nnx.to_pure_dict(nnx.state(qt_model, nnx.Param)),
        qwix.quantize_model(model, qwix.PtqProvider(rules), MODEL_INPUT),
        nnx.to_pure_dict(nnx.state(qt_model, qwix.QuantStat)),
    )
    ptq_model = qwix.quantize_model(qt_model, qwix.PtqProvider(rules), MODEL_INPUT)
    # The QT statistics were consumed and turned into static scales.
    assert not jax.tree.leaves(nnx.state(ptq_model, qwix.QuantStat))
    ours = nnx.to_pure_dict(nnx.state(ptq_model))
    np.testing.assert_allclose(
        ours["linear1"]["dot_general0_lhs_scale"]["array"],
        ptq_params["linear1"]["dot_general0_lhs_scale"]["array"],
    )
    np.testing.assert_allclose(ptq_model(MODEL_INPUT), qt_out, atol=1e-5)
    # The sample's other spelling: the converted PTQ model itself as the template.
    from_converted = qwix.quantize_params(
        nnx.to_pure_dict(nnx.state(qt_model, nnx.Param)),
        ptq_model,
        nnx.to_pure_dict(nnx.state(qt_model, qwix.QuantStat)),
    )
    jax.tree.map(np.testing.assert_array_equal, from_converted, ptq_params)
