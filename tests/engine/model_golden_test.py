"""Whole PTQ models match the reference bit for bit, eagerly and under nnx.jit.

Inside one jit XLA rounds some of the weight quotients differently from an op-by-op run, and
so does the reference: its jitted codes differ from its eager ones. The fixtures hold both modes
(make_model_golden.py), so this catches qmill drifting from either.

Quantized values and scales are compared bit for bit on every CPU. The float model output is not:
it is a float matmul whose rounding depends on the CPU's instructions (on an AMD EPYC with
avx512_bf16, XLA's bf16 dot rounds once where AVX2 code rounds twice). A different rounding of the
same sum moves a result by a few units of the *terms'* magnitude, not of the result's: where the
terms cancel, the result is small and the same absolute error is many of its own ulps (seen: 89
float32 ulps at an element of 0.02, 2.4e-7 in absolute terms, on such a CPU). So the output is
compared within MAX_OUTPUT_EPS machine epsilons of the output's largest magnitude: loose enough for
any order or rounding of the same products, tight enough that one wrong code (which moves an
output by about one scale step, ~1e-3 of its magnitude, ~10^4 epsilons) or a wrong scale fails.
"""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import qmill.engine as qwix
from tests.engine import make_model_golden as golden

FIXTURES = np.load(golden.OUT)
MAX_OUTPUT_EPS = 8


def as_floats(bits: np.ndarray) -> np.ndarray:
    """The float values behind make_model_golden.as_bits' raw bits, widened to float64."""
    dtype = {2: ml_dtypes.bfloat16, 4: np.float32}[bits.dtype.itemsize]
    return bits.view(dtype).astype(np.float64)


def output_mismatch(actual_bits: np.ndarray, expected_bits: np.ndarray) -> float:
    """Largest |actual - expected| in machine epsilons of the expected output's magnitude."""
    dtype = {2: ml_dtypes.bfloat16, 4: np.float32}[actual_bits.dtype.itemsize]
    actual, expected = as_floats(actual_bits), as_floats(expected_bits)
    unit = float(ml_dtypes.finfo(dtype).eps) * np.abs(expected).max()
    return float(np.abs(actual - expected).max() / unit)


@pytest.fixture(scope="module")
def qmill_arrays() -> dict[str, np.ndarray]:
    return golden.record(qwix)


@pytest.mark.parametrize("case", [c[0] for c in golden.CASES])
@pytest.mark.parametrize("mode", ["jit", "eager"])
def test_model_matches_reference(qmill_arrays, case, mode):
    keys = [k for k in FIXTURES.files if k.startswith(f"{case}/{mode}/")]
    assert len(keys) >= 5  # two layers' qvalue + scale, and the output
    assert {k for k in qmill_arrays if k.startswith(f"{case}/{mode}/")} == set(keys)
    for key in keys:
        if key.endswith("/output"):
            mismatch = output_mismatch(qmill_arrays[key], FIXTURES[key])
            assert mismatch <= MAX_OUTPUT_EPS, f"{key}: {mismatch:.1f} epsilons apart"
        else:
            np.testing.assert_array_equal(qmill_arrays[key], FIXTURES[key], err_msg=key)


def test_output_tolerance_catches_one_wrong_code():
    # The tolerance must stay far below what one code off by one does to the output.
    _, model = golden.quantized_models(qwix, "int8", None, "bfloat16")
    expected = golden.as_bits(np.asarray(model(golden.model_input())))
    qvalue = model.linear2.kernel.array.qvalue
    codes = np.asarray(qvalue[...]).copy()
    codes[0, 0] += 1 if codes[0, 0] < 127 else -1
    qvalue[...] = jnp.asarray(codes)
    changed = golden.as_bits(np.asarray(model(golden.model_input())))
    assert output_mismatch(changed, expected) > 10 * MAX_OUTPUT_EPS


def test_reference_jit_differs_from_eager():
    # Why both modes are recorded: a single expectation could not hold for both.
    differing = [
        k
        for k in FIXTURES.files
        if k.startswith("w8a8_f32/jit/")
        and not np.array_equal(FIXTURES[k], FIXTURES[k.replace("/jit/", "/eager/")])
    ]
    assert any("qvalue" in k for k in differing)
