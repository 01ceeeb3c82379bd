"""Calibrated methods on the model-free path: a method program's statistics, applied tensor by
tensor (contrib/leaf.py), give exactly the params gptq.quantize_params gives in the model."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import linen as nn

import qmill.engine as qe
from qmill.engine.contrib import gptq
from qmill.engine.contrib import leaf as contrib_leaf
from qmill.engine.modelfree import layout, recipes
from qmill.engine.programs import build, program

KEYS = jax.random.split(jax.random.key(7), 3)
MIX = jax.random.normal(KEYS[0], (256, 256)) / 8 + np.eye(256)
BATCHES = [jax.random.normal(k, (16, 256)) @ MIX for k in jax.random.split(KEYS[1], 2)]


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="out")(nn.relu(nn.Dense(128, name="hidden")(x)))


def _stats(method: str, rules):
    params = Mlp().init(KEYS[2], BATCHES[0])["params"]
    data, _ = build.calibration_program(Mlp(), rules, BATCHES[0], params=params, method=method)
    prog = program.load(data)
    assert prog.stat_qtypes == {}  # a method's statistics make no static scale
    step, stats = program.calibrate_step(prog), program.zero_stats(prog)
    for x in BATCHES:
        stats = step(params, stats, x)
    return params, stats


@pytest.mark.slow
def test_gptq_leaf_matches_the_model_path() -> None:
    rules = [qe.QuantizationRule(module_path="hidden", weight_qtype="int4", tile_size=128)]
    params, stats = _stats("gptq", rules)
    found = contrib_leaf.method_stats(program.flat_paths(stats))
    assert set(found) == {"hidden/kernel"} and found["hidden/kernel"][0] == "gptq"
    assert int(found["hidden/kernel"][1]["count"]) == 2
    # In the model: the PTQ abstract params say how each weight is quantized.
    ptq_model = qe.quantize_model(Mlp(), qe.PtqProvider(rules))
    abstract = jax.eval_shape(ptq_model.init, KEYS[2], BATCHES[0])["params"]
    expected = gptq.quantize_params(params, abstract, stats)["hidden"]["kernel"].array
    # Model-free: the int4 preset's plan for the same tensor.
    recipe = recipes.recipe_from_mapping(
        {"rules": [{"path_regex": ".*", "qtype": "int4", "tile_size": 128}]}
    )
    kernel = np.asarray(params["hidden"]["kernel"])
    plan = layout.plan_leaf("hidden/kernel", kernel.shape, kernel.dtype, recipe)
    result = contrib_leaf.quantizer(found)(kernel, plan)
    np.testing.assert_array_equal(result.codes(), np.asarray(expected.qvalue))
    np.testing.assert_array_equal(result.scale, np.asarray(expected.scale))
    rtn = contrib_leaf.quantizer({})(kernel, plan)  # no statistics: plain RTN
    assert not np.array_equal(rtn.codes(), result.codes())


def test_awq_statistics_are_collected_but_not_served_model_free() -> None:
    rules = [qe.QuantizationRule(module_path="hidden", weight_qtype="int4", tile_size=128)]
    params, stats = _stats("awq", rules)
    found = contrib_leaf.method_stats(program.flat_paths(stats))
    assert found["hidden/kernel"][0] == "awq"
    recipe = recipes.recipe_from_mapping({"rules": [{"path_regex": ".*", "qtype": "int4"}]})
    kernel = np.asarray(params["hidden"]["kernel"])
    plan = layout.plan_leaf("hidden/kernel", kernel.shape, kernel.dtype, recipe)
    with pytest.raises(ValueError, match="awq_scale"):
        contrib_leaf.quantizer(found)(kernel, plan)


def test_statistics_of_another_shape_are_refused() -> None:
    recipe = recipes.recipe_from_mapping({"rules": [{"path_regex": ".*", "qtype": "int8"}]})
    plan = layout.plan_leaf("w/kernel", (64, 8), np.float32, recipe)
    stat = {"count": np.int32(1), "sum_of_hessian": np.eye(32, dtype=np.float32)}
    with pytest.raises(ValueError, match="do not match"):
        contrib_leaf.quantize_leaf(np.ones((64, 8), np.float32), plan, "gptq", stat)
