"""GPTQ, AWQ and SmoothQuant give the reference's (qwix 0.1.8) results bit for bit.

The expected values were recorded by make_contrib_golden.py from the reference on the inputs of
contrib_cases.py; see there for what is recorded and why GPTQ is compared under jax.jit.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qmill.engine as qe
from qmill.engine import qarray
from qmill.engine.contrib import awq_core, gptq_core
from qmill.engine.contrib import smooth_quant as sq
from tests.engine.contrib.contrib_cases import GPTQ_CASES, Mlp, bits, digest, inputs

GOLDEN = np.load(pathlib.Path(__file__).parent / "golden" / "contrib.npz")
DATA = inputs()
W, X, ACTS = (jnp.asarray(DATA[k]) for k in ("w", "x", "acts"))


def _how(qtype: str, tile: int | None) -> qarray.HowToQuantize:
    tiled = {1: tile} if tile else {}
    return qarray.HowToQuantize(qtype=qtype, channelwise_axes=(0,), tiled_axes=tiled)


def test_inputs_are_the_recorded_ones() -> None:
    assert digest(DATA) == GOLDEN["inputs_sha256"].tobytes()


@pytest.mark.parametrize(("name", "qtype", "tile", "block"), GPTQ_CASES)
def test_gptq_matches_the_reference(name, qtype, tile, block) -> None:
    fn = functools.partial(gptq_core.quantize_weight, how=_how(qtype, tile), blocksize=block)
    q, losses = jax.jit(fn)(W, gptq_core.compute_hessian(X))
    np.testing.assert_array_equal(bits(q.qvalue), GOLDEN[f"gptq_{name}_qvalue"])
    np.testing.assert_array_equal(bits(q.scale), GOLDEN[f"gptq_{name}_scale"])
    np.testing.assert_array_equal(bits(losses), GOLDEN[f"gptq_{name}_losses"])


def test_awq_matches_the_reference() -> None:
    q, scales = awq_core.quantize_weight(W, awq_core.compute_act_scale(ACTS), _how("int4", 32))
    np.testing.assert_array_equal(bits(q.qvalue), GOLDEN["awq_qvalue"])
    np.testing.assert_array_equal(bits(q.scale), GOLDEN["awq_scale"])
    np.testing.assert_array_equal(bits(scales), GOLDEN["awq_s"])


@pytest.mark.slow
def test_smooth_quant_model_flow_matches_the_reference() -> None:
    model = Mlp()
    variables = model.init(jax.random.key(1), ACTS[:8])
    rules = [sq.SqRule(module_path="Dense_0", weight_qtype="int8", act_qtype="int8")]
    calibrating = qe.quantize_model(model, sq.SqCalibrationProvider(rules))
    for batch in (ACTS[:32], ACTS[32:]):
        _, new = calibrating.apply(variables, batch, mutable="quant_stats")
        variables = {**variables, **new}
    stats = variables["quant_stats"]["Dense_0"]["kernel_sq"]
    assert int(stats["count"]) == 2
    np.testing.assert_array_equal(bits(stats["sum_of_sq_scale"]), GOLDEN["sq_sum"])
    np.testing.assert_array_equal(bits(stats["sum_of_inv_sq_scale"]), GOLDEN["sq_inv_sum"])
    ptq_model = qe.quantize_model(model, qe.PtqProvider(rules))
    abstract = jax.eval_shape(ptq_model.init, jax.random.key(1), ACTS[:8])["params"]
    params = sq.quantize_params(variables["params"], abstract, variables["quant_stats"])
    kernel = params["Dense_0"]["kernel"]
    assert isinstance(kernel, sq.WithSqScale) and kernel.contracting_axis == 0
    np.testing.assert_array_equal(bits(kernel.array.qvalue), GOLDEN["sq_qvalue"])
    np.testing.assert_array_equal(bits(kernel.array.scale), GOLDEN["sq_scale"])
    serving = qe.quantize_model(model, sq.SqInferenceProvider(rules))
    y = serving.apply({"params": params}, ACTS[:8])
    np.testing.assert_array_equal(bits(y), GOLDEN["sq_y"])
