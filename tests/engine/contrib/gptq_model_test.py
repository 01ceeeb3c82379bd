"""GPTQ on whole models: calibrate the Hessians, quantize_params, serve with PtqProvider."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import qmill.engine as qe
from qmill.engine.contrib import gptq
from tests import random_inputs
from tests.engine.contrib.contrib_cases import ReluMlp

KEYS = jax.random.split(jax.random.key(0), 4)
MIX = random_inputs.normal(KEYS[0], (64, 64)) / 4 + jnp.eye(64)  # correlated input features
BATCHES = [random_inputs.normal(k, (128, 64)) @ MIX for k in jax.random.split(KEYS[1], 3)]
TEST_X = random_inputs.normal(KEYS[2], (256, 64)) @ MIX


class NnxMlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(64, 32, rngs=rngs)
        self.out = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x)))


def _error(out, ref) -> float:
    return float(jnp.linalg.norm(out - ref))


def test_linen_gptq_beats_round_to_nearest_and_keeps_ptq_layout() -> None:
    # The hidden layer by GPTQ, the output layer by plain PTQ (its stats are never collected).
    rules = [
        gptq.GptqRule(module_path="hidden", weight_qtype="int4", tile_size=16),
        qe.QuantizationRule(module_path="out", weight_qtype="int4", tile_size=16),
    ]
    calibrating = qe.quantize_model(ReluMlp(), gptq.GptqCalibrationProvider(rules))
    variables = calibrating.init(KEYS[3], BATCHES[0])
    params, stats = variables["params"], variables["quant_stats"]
    for x in BATCHES:
        _, updated = calibrating.apply(
            {"params": params, "quant_stats": stats}, x, mutable=["quant_stats"]
        )
        stats = updated["quant_stats"]
    assert set(stats) == {"hidden"}
    hidden = stats["hidden"]["kernel_gptq"]
    assert int(hidden["count"]) == 3 and hidden["sum_of_hessian"].shape == (64, 64)

    ptq_model = qe.quantize_model(ReluMlp(), qe.PtqProvider(rules))
    abstract = jax.eval_shape(ptq_model.init, KEYS[3], BATCHES[0])["params"]
    by_gptq = gptq.quantize_params(params, abstract, stats)
    by_rtn = qe.quantize_params(params, abstract)
    assert jax.tree.structure(by_gptq) == jax.tree.structure(by_rtn)
    g, r = by_gptq["hidden"]["kernel"].array, by_rtn["hidden"]["kernel"].array
    assert g.qvalue.dtype == r.qvalue.dtype and g.scale.shape == r.scale.shape == (4, 32)
    # Weights without statistics are quantized exactly as PTQ does.
    for leaf_g, leaf_r in zip(
        jax.tree.leaves(by_gptq["out"]), jax.tree.leaves(by_rtn["out"]), strict=True
    ):
        np.testing.assert_array_equal(leaf_g, leaf_r)
    ref = ReluMlp().apply({"params": params}, TEST_X)
    gptq_error = _error(ptq_model.apply({"params": by_gptq}, TEST_X), ref)
    rtn_error = _error(ptq_model.apply({"params": by_rtn}, TEST_X), ref)
    assert gptq_error < 0.95 * rtn_error  # measured 0.8 here (both layers GPTQ: 0.81)


def test_nnx_gptq_flow() -> None:
    rules = [gptq.GptqRule(module_path=".*", weight_qtype="int4", tile_size=16)]
    fp = NnxMlp(nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(fp, nnx.Param))
    calibrating = qe.quantize_model(
        NnxMlp(nnx.Rngs(0)), gptq.GptqCalibrationProvider(rules), BATCHES[0]
    )
    for x in BATCHES:
        calibrating(x)
    stats = nnx.to_pure_dict(nnx.state(calibrating, qe.QuantStat))
    assert int(stats["hidden"]["kernel_gptq"]["count"]) == 3  # init run not counted
    ptq_model = qe.quantize_model(NnxMlp(nnx.Rngs(0)), qe.PtqProvider(rules), BATCHES[0])
    by_gptq = gptq.quantize_params(params, ptq_model, stats)
    by_rtn = qe.quantize_params(params, ptq_model)
    assert jax.tree.structure(by_gptq) == jax.tree.structure(by_rtn)
    ref = fp(TEST_X)
    nnx.update(ptq_model, by_gptq)
    gptq_error = _error(ptq_model(TEST_X), ref)
    nnx.update(ptq_model, by_rtn)
    rtn_error = _error(ptq_model(TEST_X), ref)
    assert gptq_error < 0.9 * rtn_error  # measured 0.76
