"""GPTQ with static group scales (gptq_core.quantize_weight_static), as language models use it."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from qmill.engine.contrib import gptq_core, gptq_host
from qmill.engine.core import qarray

HOW = qarray.HowToQuantize(qtype="int4", channelwise_axes=(0,), tiled_axes={1: 32})


def _problem(seed: int = 0) -> tuple[jnp.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.normal(size=(48, 128)).astype(np.float32)).astype(jnp.bfloat16)
    # Inputs whose features differ in scale and correlate, as a layer's do.
    mix = rng.normal(size=(128, 128)).astype(np.float32) * 0.2 + np.eye(128, dtype=np.float32)
    x = (rng.normal(size=(1024, 128)).astype(np.float32) * np.linspace(0.1, 3, 128)) @ mix
    return w, x


def _output_error(w: jnp.ndarray, q: qarray.QArray, x: np.ndarray) -> float:
    err = np.asarray(w, np.float32) - np.asarray(qarray.dequantize(q), np.float32)
    return float(np.sum((x @ err.T) ** 2))


@pytest.mark.parametrize("actorder", [False, True])
def test_scales_are_round_to_nearest_scales_and_output_error_is_lower(actorder: bool) -> None:
    w, x = _problem()
    options = gptq_core.GptqOptions(actorder=actorder)
    q, losses = gptq_core.quantize_weight_static(w, jnp.asarray(x.T @ x), HOW, options)
    rtn = qarray.quantize(w, HOW)
    # Static groups: every scale is the float weight's, exactly as round to nearest finds it.
    np.testing.assert_array_equal(np.asarray(q.scale), np.asarray(rtn.scale))
    assert q.qvalue.shape == w.shape and losses.shape == w.shape
    gptq_error, rtn_error = _output_error(w, q, x), _output_error(w, rtn, x)
    # GPTQ minimises ||(W - Ŵ) X||²: on its own calibration inputs it must do clearly better.
    assert gptq_error < 0.9 * rtn_error, (gptq_error, rtn_error)


def test_activation_order_lowers_the_error_further() -> None:
    w, x = _problem(1)
    h = jnp.asarray(x.T @ x)
    plain, _ = gptq_core.quantize_weight_static(w, h, HOW, gptq_core.GptqOptions(actorder=False))
    ordered, _ = gptq_core.quantize_weight_static(w, h, HOW, gptq_core.GptqOptions())
    assert _output_error(w, ordered, x) < _output_error(w, plain, x)


def test_uncorrelated_inputs_give_round_to_nearest_codes() -> None:
    # With H diagonal, no column's error moves another: GPTQ is round to nearest, in float32
    # (GPTQ works on a float32 copy of the weight, as the field's implementations do).
    w, _ = _problem(2)
    h = jnp.diag(jnp.linspace(1.0, 2.0, 128))
    q, _ = gptq_core.quantize_weight_static(w, h, HOW, gptq_core.GptqOptions())
    scale = np.repeat(np.asarray(q.scale, np.float32), 32, axis=1)
    nearest = np.clip(np.round(np.asarray(w, np.float32) / scale), -8, 7)
    np.testing.assert_array_equal(np.asarray(q.qvalue, np.float32), nearest)


def test_bad_arguments_are_refused() -> None:
    w, _ = _problem()
    with pytest.raises(ValueError, match="Hessian shape"):
        gptq_core.quantize_weight_static(w, jnp.eye(64), HOW, gptq_core.GptqOptions())
    with pytest.raises(ValueError, match="block size"):
        gptq_core.GptqOptions(blocksize=0)
    with pytest.raises(ValueError, match="dampening"):
        gptq_core.GptqOptions(percdamp=1.5)


@pytest.mark.parametrize("method", ["absmax", "minmax"])
def test_host_loop_over_shared_input_matches_the_compiled_one(method: str) -> None:
    # q/k/v take one input: one host loop over their stacked rows gives each the codes the
    # compiled per-weight GPTQ gives (rows never interact), up to a rare last-bit difference
    # where BLAS and XLA sum the block update in another order.
    w, x = _problem(3)
    h = jnp.asarray(x.T @ x)
    how = qarray.HowToQuantize(
        qtype="int4", channelwise_axes=(0,), tiled_axes={1: 32}, calibration_method=method
    )
    weights = [w, w[:16] * 0.5, w[16:40]]
    options = gptq_core.GptqOptions()
    shared = gptq_host.quantize_shared_input(weights, h, how, options)
    for weight, (q, losses) in zip(weights, shared, strict=True):
        alone, alone_losses = gptq_core.quantize_weight_static(weight, h, how, options)
        np.testing.assert_array_equal(np.asarray(q.scale), np.asarray(alone.scale))
        if method == "minmax":
            np.testing.assert_array_equal(np.asarray(q.zero_point), np.asarray(alone.zero_point))
        same = np.mean(np.asarray(q.qvalue) == np.asarray(alone.qvalue))
        assert same > 0.999, same
        np.testing.assert_allclose(np.sum(losses), np.sum(alone_losses), rtol=1e-3)


def test_host_loop_refuses_what_it_cannot_do() -> None:
    w, x = _problem()
    h = jnp.asarray(x.T @ x)
    fp8 = qarray.HowToQuantize(qtype="float8_e4m3fn", channelwise_axes=(0,))
    with pytest.raises(ValueError, match="integer qtypes"):
        gptq_host.quantize_shared_input([w], h, fp8, gptq_core.GptqOptions())
    with pytest.raises(ValueError, match="do not share columns"):
        gptq_host.quantize_shared_input([w, w[:, :64]], h, HOW, gptq_core.GptqOptions())
    singular = jnp.asarray(-np.eye(128, dtype=np.float32))
    with pytest.raises(ValueError, match="not positive definite"):
        gptq_host.quantize_shared_input([w], singular, HOW, gptq_core.GptqOptions())
