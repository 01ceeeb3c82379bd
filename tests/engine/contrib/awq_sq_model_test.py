"""AWQ and SmoothQuant on whole models, and what the calibration providers record."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qmill.engine as qe
from qmill.engine import flax_util
from qmill.engine.contrib import awq, gptq
from qmill.engine.contrib import smooth_quant as sq
from tests import random_inputs
from tests.engine.contrib.contrib_cases import ReluMlp

KEYS = jax.random.split(jax.random.key(3), 3)
OUTLIERS = jnp.ones(64).at[::8].set(40.0)  # salient input channels: AWQ's and SQ's setting
X = random_inputs.normal(KEYS[0], (64, 64)) * OUTLIERS
# Linen's default names: the reference's own examples name no layers.
NAMES = ("Dense_0", "Dense_1")


class RawParam(nnx.Module):
    def __init__(self) -> None:
        self.w = nnx.Param(random_inputs.normal(KEYS[1], (64, 16)))

    def __call__(self, x):
        return jnp.einsum("bi,io->bo", x, self.w)


def _mae(a, b) -> float:
    return float(jnp.mean(jnp.abs(a - b)))


@pytest.mark.slow
def test_linen_awq_beats_rtn_and_writes_the_reference_layout() -> None:
    model = ReluMlp(names=NAMES)
    variables = model.init(KEYS[2], X)
    rules = [awq.AwqRule(module_path="Dense_0", weight_qtype="int4", tile_size=16)]
    calibrating = qe.quantize_model(model, awq.AwqCalibrationProvider(rules))
    _, stats = calibrating.apply(variables, X, mutable="quant_stats")
    act = stats["quant_stats"]["Dense_0"]["kernel_awq"]["sum_of_act_scale"]
    np.testing.assert_allclose(act, jnp.mean(jnp.abs(X), axis=0), rtol=1e-6)
    ptq_model = qe.quantize_model(model, qe.PtqProvider(rules))
    abstract = jax.eval_shape(ptq_model.init, KEYS[2], X)["params"]
    params = awq.quantize_params(variables["params"], abstract, stats["quant_stats"])
    paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
    assert "['Dense_0']['kernel'].awq_scale" in paths
    assert "['Dense_0']['kernel'].array.qvalue" in paths
    assert params["Dense_0"]["kernel"].awq_scale.shape == (64,)
    ref = model.apply(variables, X)
    served = qe.quantize_model(model, awq.AwqInferenceProvider(rules)).apply({"params": params}, X)
    rtn = ptq_model.apply({"params": qe.quantize_params(variables["params"], abstract)}, X)
    assert _mae(served, ref) < 0.95 * _mae(rtn, ref)  # measured 0.87
    # jnp.asarray of the weight gives the float weight it stands for (scales divided out).
    kernel = params["Dense_0"]["kernel"]
    np.testing.assert_allclose(
        jnp.asarray(kernel), variables["params"]["Dense_0"]["kernel"], atol=0.2
    )


def test_raw_nnx_param_through_einsum_collects_statistics() -> None:
    for provider, key in (
        (gptq.GptqCalibrationProvider([gptq.GptqRule(weight_qtype="int8")]), "sum_of_hessian"),
        (awq.AwqCalibrationProvider([awq.AwqRule(weight_qtype="int8")]), "sum_of_act_scale"),
    ):
        model = qe.quantize_model(RawParam(), provider, X)
        model(X)
        stats = nnx.to_pure_dict(nnx.state(model, flax_util.QuantStat))
        (name,) = stats
        assert name.startswith("w_") and int(stats[name]["count"]) == 1
        assert stats[name][key].shape[0] == 64


@pytest.mark.slow
def test_nnx_awq_params_are_a_pure_dict_with_the_scales() -> None:
    rules = [awq.AwqRule(weight_qtype="int4", tile_size=16)]
    calibrating = qe.quantize_model(
        nnx.Linear(64, 16, rngs=nnx.Rngs(0)), awq.AwqCalibrationProvider(rules), X
    )
    calibrating(X)
    stats = nnx.to_pure_dict(nnx.state(calibrating, flax_util.QuantStat))
    params = nnx.to_pure_dict(nnx.state(calibrating, nnx.Param))
    ptq_model = qe.quantize_model(nnx.Linear(64, 16, rngs=nnx.Rngs(0)), qe.PtqProvider(rules), X)
    out = awq.quantize_params(params, ptq_model, stats)
    assert set(out["kernel"]) == {"array", "awq_scale"}
    assert out["kernel"]["awq_scale"].shape == (64,)


def test_smooth_quant_without_act_qtype_is_refused() -> None:
    model = ReluMlp(names=NAMES)
    variables = model.init(KEYS[2], X)
    calibrating = qe.quantize_model(
        model, sq.SqCalibrationProvider([sq.SqRule(weight_qtype="int8")])
    )
    with pytest.raises(ValueError, match="act_qtype"):
        calibrating.apply(variables, X, mutable="quant_stats")
