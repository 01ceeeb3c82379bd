"""Whole PTQ models match the reference bit for bit, eagerly and under nnx.jit.

Inside one jit XLA rounds some of the weight quotients differently from an op-by-op run, and
so does the reference: its jitted codes differ from its eager ones. The fixtures hold both modes
(make_model_golden.py), so this catches qmill drifting from either.

Quantized values and scales are compared bit for bit on every CPU. The float model output is not:
it is a float matmul whose last bit depends on the CPU's instructions (on an AMD EPYC with
avx512_bf16, XLA's bf16 dot rounds once where AVX2 code rounds twice, and w8_bf16's output came out
1058802352 vs 1058802351 as bits: one ulp). The output is compared within MAX_OUTPUT_ULPS units in
the last place of its own dtype instead -- loose enough for a different rounding of the same sums,
tight enough that any wrong code or scale (which moves outputs by thousands of bf16 ulps) fails.
"""

import numpy as np
import pytest

import qmill.engine as qwix
from tests.engine import make_model_golden as golden

FIXTURES = np.load(golden.OUT)
MAX_OUTPUT_ULPS = 2


def _ordered(bits: np.ndarray) -> np.ndarray:
    """Float bit patterns (as unsigned ints) mapped to integers in the order of their values, so
    that the difference of two is their distance in units in the last place."""
    width = bits.dtype.itemsize * 8
    signed = bits.astype(np.int64)
    sign = np.int64(1) << (width - 1)
    return np.where(signed & sign, -(signed & (sign - 1)), signed)


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
            ulps = np.abs(_ordered(qmill_arrays[key]) - _ordered(FIXTURES[key]))
            assert ulps.max() <= MAX_OUTPUT_ULPS, f"{key}: {ulps.max()} ulps apart"
        else:
            np.testing.assert_array_equal(qmill_arrays[key], FIXTURES[key], err_msg=key)


def test_ulp_distance_counts_units_in_the_last_place_across_zero():
    values = np.array([1.0, np.nextafter(np.float32(1.0), np.float32(2)), 0.0, -0.0], np.float32)
    d = _ordered(values.view(np.uint32))
    assert d[1] - d[0] == 1 and d[2] == d[3] == 0
    tiny = np.array([np.float32(1e-45), -np.float32(1e-45)], np.float32).view(np.uint32)
    assert abs(int(np.diff(_ordered(tiny))[0])) == 2


def test_reference_jit_differs_from_eager():
    # Why both modes are recorded: a single expectation could not hold for both.
    differing = [
        k
        for k in FIXTURES.files
        if k.startswith("w8a8_f32/jit/")
        and not np.array_equal(FIXTURES[k], FIXTURES[k.replace("/jit/", "/eager/")])
    ]
    assert any("qvalue" in k for k in differing)
