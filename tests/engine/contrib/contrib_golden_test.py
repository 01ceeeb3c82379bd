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


# Where the reference's result comes out of XLA:CPU's dot and Cholesky kernels (GPTQ's later
# group scales and losses, SmoothQuant's statistics and outputs), their summation order follows
# the CPU's vector width: recorded on one x86-64 machine, the same code gives 1-ulp different
# scales on another (an AMD EPYC VM, 2026-11-27: 7 of 64 GPTQ scales, codes all equal). Codes
# stay exact; scales within 2 ulp; sums of many products within a relative 1e-5 of their
# largest value; GPTQ's per-element losses, (w − q)² of weights that carry every earlier
# column's error feedback, within 1e-3 each (measured: 1.2e-4 at most) and 1e-5 in total.
SCALE_ULPS = 2


def _close(actual: jax.Array, golden: np.ndarray, rtol: float = 1e-5) -> None:
    want = golden.view(np.float32) if golden.dtype != np.float32 else golden
    got = np.asarray(actual, np.float32)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * float(np.max(np.abs(want))))
    np.testing.assert_allclose(
        np.sum(got, dtype=np.float64), np.sum(want, dtype=np.float64), rtol=1e-5
    )


def _ulps(actual: jax.Array, golden: np.ndarray) -> None:
    want = golden.view(np.float32) if golden.dtype != np.float32 else golden
    np.testing.assert_array_max_ulp(np.asarray(actual, np.float32), want, maxulp=SCALE_ULPS)


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
    _ulps(q.scale, GOLDEN[f"gptq_{name}_scale"])
    _close(losses, GOLDEN[f"gptq_{name}_losses"], rtol=1e-3)


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
    _close(stats["sum_of_sq_scale"], GOLDEN["sq_sum"])
    _close(stats["sum_of_inv_sq_scale"], GOLDEN["sq_inv_sum"])
    ptq_model = qe.quantize_model(model, qe.PtqProvider(rules))
    abstract = jax.eval_shape(ptq_model.init, jax.random.key(1), ACTS[:8])["params"]
    params = sq.quantize_params(variables["params"], abstract, variables["quant_stats"])
    kernel = params["Dense_0"]["kernel"]
    assert isinstance(kernel, sq.WithSqScale) and kernel.contracting_axis == 0
    np.testing.assert_array_equal(bits(kernel.array.qvalue), GOLDEN["sq_qvalue"])
    _ulps(kernel.array.scale, GOLDEN["sq_scale"])
    serving = qe.quantize_model(model, sq.SqInferenceProvider(rules))
    y = serving.apply({"params": params}, ACTS[:8])
    _close(y, GOLDEN["sq_y"])
