"""QEP gives the reference's (qwix 0.1.8) results: codes bit for bit, scales within the GPTQ
goldens' 2 ulp, statistics and outputs within their relative 1e-5 (see contrib_golden_test.py
for why the CPU's kernels allow no tighter bound on another machine).

The expected values were recorded by make_qep_golden.py from the reference on contrib_cases'
inputs and Branch model.
"""

from __future__ import annotations

import functools
import pathlib

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qmill.engine as qe
from qmill.engine.contrib import leaf as contrib_leaf
from qmill.engine.contrib import qep, qep_core
from qmill.engine.modelfree import layout, recipes
from tests.engine.contrib.contrib_cases import KERNELS, QEP_CASES, Branch, bits, qep_inputs
from tests.engine.contrib.contrib_golden_test import _close, _ulps

GOLDEN = np.load(pathlib.Path(__file__).parent / "golden" / "qep.npz")
W, X, X_Q, BATCHES = qep_inputs()
W, X, X_Q = jnp.asarray(W), jnp.asarray(X), jnp.asarray(X_Q)


def test_core_matches_the_reference() -> None:
    stats = qep_core.compute_qep_stats(X_Q, X)
    _close(stats["hessian"], GOLDEN["core_hessian"])
    _close(stats["hessian_delta"], GOLDEN["core_hessian_delta"])
    corrected = qep_core.weight_correct(W, stats["hessian"], stats["hessian_delta"])
    _close(corrected, GOLDEN["core_corrected"])


@functools.cache
def _model() -> tuple[Branch, dict]:
    model = Branch()
    return model, model.init(jax.random.key(41), BATCHES[0])


@functools.cache
def _run(qtype: str, tile: int | None, block: int) -> qep.QepResult:
    model, variables = _model()
    rules = [qep.QepRule(module_path=".*", weight_qtype=qtype, tile_size=tile)]
    return qep.quantize(model, BATCHES, rules, variables=variables, gptq_block_size=block)


@pytest.mark.parametrize(("name", "qtype", "tile", "block"), QEP_CASES)
def test_quantize_matches_the_reference(name, qtype, tile, block) -> None:
    result = _run(qtype, tile, block)
    assert [",".join(s.module_paths) for s in result.stages] == list(GOLDEN[f"{name}_stages"])
    assert result.stages[1].param_paths == (("DenseA", "kernel"), ("DenseB", "kernel"))
    for module, param in KERNELS:
        q = result.params[module][param].array
        np.testing.assert_array_equal(bits(q.qvalue), GOLDEN[f"{name}_{module}_qvalue"])
        # The reference's own (op-by-op) run gives the same codes.
        np.testing.assert_array_equal(bits(q.qvalue), GOLDEN[f"{name}_{module}_qvalue_eager"])
        _ulps(q.scale, GOLDEN[f"{name}_{module}_scale"])
        stat = result.quant_stats[module][param + "_qep"]
        assert int(stat["count"]) == len(BATCHES)
        _close(stat["sum_of_hessian"], GOLDEN[f"{name}_{module}_hessian"])
        _close(stat["sum_of_hessian_delta"], GOLDEN[f"{name}_{module}_delta"])
    _close(result.model.apply({"params": result.params}, BATCHES[0]), GOLDEN[f"{name}_y"])


def test_quantize_params_on_recorded_statistics_gives_the_same_weights() -> None:
    """The offline path: QEP statistics from quantize, weights from quantize_params alone."""
    _, variables = _model()
    _, qtype, tile, block = QEP_CASES[0]
    result = _run(qtype, tile, block)
    abstract = jax.eval_shape(result.model.init, jax.random.key(0), BATCHES[0])["params"]
    params = qep.quantize_params(
        variables["params"], abstract, result.quant_stats, gptq_block_size=block
    )
    for module, param in KERNELS:
        got, want = params[module][param].array, result.params[module][param].array
        np.testing.assert_array_equal(got.qvalue, want.qvalue)


def test_refusals_name_the_fix() -> None:
    model, variables = _model()
    rule = qep.QepRule(module_path="Nothing", weight_qtype="int8")
    with pytest.raises(ValueError, match="No supported QEP ops"):
        qep.quantize(model, BATCHES, [rule], variables=variables)
    with pytest.raises(ValueError, match="reiterable"):
        qep.quantize(model, iter(BATCHES), [rule], variables=variables)
    with pytest.raises(ValueError, match="at least one batch"):
        qep.quantize(model, [], [rule], variables=variables)
    with pytest.raises(ValueError, match="variables"):
        qep.quantize(model, BATCHES, [rule])
    abstract = jax.eval_shape(_run(*QEP_CASES[0][1:]).model.init, jax.random.key(0), BATCHES[0])
    eye = qe.SimpleMovingAverage()
    stat = eye.update(eye.init({"hessian": jnp.eye(16)}), {"hessian": jnp.eye(16)})
    stats = {"Dense_0": {"kernel_qep": stat}}
    with pytest.raises(ValueError, match="hessian_delta"):
        qep.quantize_params(variables["params"], abstract["params"], stats)
    params = qep.quantize_params(  # GPTQ as compiled for the run above
        variables["params"], abstract["params"], stats, apply_correction=False, gptq_block_size=8
    )
    assert params["Dense_0"]["kernel"].array.qvalue.dtype == jnp.int4


def test_model_free_path_applies_qep_statistics_as_the_model_path() -> None:
    """QuantizeParams' path (contrib/leaf.py): `_qep` statistics in a calibration give, tensor by
    tensor, the weights qep.quantize gave in the model."""
    _, variables = _model()
    _, qtype, tile, block = QEP_CASES[0]
    result = _run(qtype, tile, block)
    flat = {
        "/".join(path): value
        for path, value in flax.traverse_util.flatten_dict(result.quant_stats).items()
    }
    found = contrib_leaf.method_stats(flat)
    assert {method for method, _ in found.values()} == {"qep"} and len(found) == 4
    recipe = recipes.recipe_from_mapping(
        {"rules": [{"path_regex": ".*", "qtype": qtype, "tile_size": tile}]}
    )
    for module, param in KERNELS[::3]:  # a first stage and a last one
        kernel = np.asarray(variables["params"][module][param])
        plan = layout.plan_leaf(f"{module}/{param}", kernel.shape, kernel.dtype, recipe)
        leaf = contrib_leaf.quantize_leaf(kernel, plan, *found[plan.path], blocksize=block)
        want = result.params[module][param].array
        np.testing.assert_array_equal(leaf.codes(), np.asarray(want.qvalue))
        np.testing.assert_array_equal(leaf.scale, np.asarray(want.scale))
    stat = dict(found["DenseC/kernel"][1])
    del stat["sum_of_hessian_delta"]
    with pytest.raises(ValueError, match="hessian_delta"):
        contrib_leaf.quantize_leaf(kernel, plan, "qep", stat)
