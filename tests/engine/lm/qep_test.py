"""QEP in the layer-by-layer calibration (engine/lm/qep.py, sequential.calibrate_layer with a
float stream) on a decoder layer of random weights: its second statistic is the direct sum, it
is GPTQ exactly where it has nothing to correct (a linear whose input is the float model's, or
no correction), and it brings the quantized layer's output closer to the float model's than
GPTQ does, both for the error of the layer's own earlier linears and for an error in the
layer's input. tests/interop/lm_qep_test.py runs it through `qmill quantize`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from qmill.engine.contrib import gptq_core
from qmill.engine.lm import hessian, qep, sequential
from tests.engine.lm import smoothing_test as layers

GPTQ = gptq_core.GptqOptions()


@pytest.fixture(scope="module")
def layer():
    cfg = layers._config("llama")
    weights = layers._weights(cfg)
    return cfg, weights, layers._plans(cfg, weights, layers.W4)


def _error_stream(hidden: sequential.Hidden, seed: int = 4) -> sequential.Hidden:
    """`hidden` as a partly quantized model passes it on: each channel off by its own factor
    (a systematic error, what earlier quantized layers leave) plus a little noise."""
    rng = np.random.default_rng(seed)
    factor = 1.0 + 0.3 * rng.uniform(-1.0, 1.0, hidden[0].shape[-1])
    return tuple(
        jnp.asarray(np.asarray(h) * factor + rng.normal(0.0, 0.05, h.shape), jnp.float32)
        for h in hidden
    )


def _codes(done: sequential.LayerCalibration) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {n: (np.asarray(r.qvalue), np.asarray(r.scale)) for n, r in done.results.items()}


def _same(a: sequential.LayerCalibration, b: sequential.LayerCalibration) -> bool:
    x, y = _codes(a), _codes(b)
    return x.keys() == y.keys() and all(
        np.array_equal(x[n][0], y[n][0]) and np.array_equal(x[n][1], y[n][1]) for n in x
    )


def test_the_second_statistic_is_the_input_error_times_the_input():
    rng = np.random.default_rng(0)
    floats = [rng.normal(size=(4, 32, 64)).astype(np.float32) for _ in range(3)]
    quantized = [x + rng.normal(0.0, 0.1, x.shape).astype(np.float32) for x in floats]
    got = None
    for xf, xq in zip(floats, quantized, strict=True):
        got = hessian.add_delta(got, jnp.asarray(xf), jnp.asarray(xq))
    xf = np.concatenate([x.reshape(-1, 64) for x in floats]).astype(np.float64)
    xq = np.concatenate([x.reshape(-1, 64) for x in quantized]).astype(np.float64)
    want = (xf - xq).T @ xq
    # float32 sums of 384 products against float64's.
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-4 * np.abs(want).max())
    with pytest.raises(ValueError, match="differ in shape"):
        hessian.add_delta(None, jnp.zeros((2, 64)), jnp.zeros((3, 64)))


def test_without_an_error_or_a_correction_qep_is_gptq(layer):
    cfg, weights, plans = layer
    hidden = layers._hidden(cfg)
    gptq = sequential.calibrate_layer(cfg, 0, weights, hidden, plans, GPTQ)
    same_streams = sequential.calibrate_layer(
        cfg, 0, weights, hidden, plans, GPTQ, qep=qep.QepOptions(), reference=hidden
    )
    # The layer's first linears see the same input in both models: H_delta = 0, nothing moves.
    # The later ones see the error of the quantized linears before them, and are corrected.
    first = [n for n in gptq.results if n.split(".")[-2] in ("q_proj", "k_proj", "v_proj")]
    assert len(first) == 3
    got, want = _codes(same_streams), _codes(gptq)
    for name in first:
        assert np.array_equal(got[name][0], want[name][0]), name
        assert np.array_equal(got[name][1], want[name][1]), name
    for name in set(got) - set(first):
        assert not np.array_equal(got[name][0], want[name][0]), name
    assert set(same_streams.methods.values()) == {"qep"} and len(same_streams.methods) == 7
    float_out = sequential.run_layer(cfg, 0, weights, hidden)
    for got, want in zip(same_streams.reference, float_out, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    shifted = _error_stream(hidden)
    gptq = sequential.calibrate_layer(cfg, 0, weights, shifted, plans, GPTQ)
    uncorrected = sequential.calibrate_layer(
        cfg, 0, weights, shifted, plans, GPTQ,
        qep=qep.QepOptions(correction=0.0), reference=hidden,
    )  # fmt: skip
    assert _same(uncorrected, gptq)
    corrected = sequential.calibrate_layer(
        cfg, 0, weights, shifted, plans, GPTQ, qep=qep.QepOptions(), reference=hidden
    )
    assert not _same(corrected, gptq)


@pytest.mark.parametrize("correction", [0.5, 1.0])
@pytest.mark.parametrize("input_error", [False, True])
def test_qep_brings_the_layers_output_closer_to_the_float_models(layer, correction, input_error):
    cfg, weights, plans = layer
    hidden = layers._hidden(cfg)
    shifted = _error_stream(hidden) if input_error else hidden
    gptq = sequential.calibrate_layer(cfg, 0, weights, shifted, plans, GPTQ)
    done = sequential.calibrate_layer(
        cfg, 0, weights, shifted, plans, GPTQ,
        qep=qep.QepOptions(correction=correction), reference=hidden,
    )  # fmt: skip

    def error(out: sequential.Hidden) -> float:
        return sum(
            float(np.sum((np.asarray(a) - np.asarray(b)) ** 2))
            for a, b in zip(out, done.reference, strict=True)
        )

    # Measured: 0.65 (α 0.5) and 0.57 (α 1) of GPTQ's error from the layer's own linears alone,
    # 0.37 and 0.27 with the input's error too.
    assert error(done.hidden) < 0.8 * error(gptq.hidden)


def test_qep_needs_its_float_stream_and_nothing_else_takes_one(layer):
    cfg, weights, plans = layer
    hidden = layers._hidden(cfg)
    with pytest.raises(ValueError, match="QEP takes the float model's hidden states"):
        sequential.calibrate_layer(cfg, 0, weights, hidden, plans, GPTQ, qep=qep.QepOptions())
    with pytest.raises(ValueError, match="QEP takes the float model's hidden states"):
        sequential.calibrate_layer(cfg, 0, weights, hidden, plans, GPTQ, reference=hidden)
    with pytest.raises(ValueError, match=r"correction must be in \[0, 1\]"):
        qep.QepOptions(correction=1.5)
