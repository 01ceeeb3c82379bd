"""Bit-for-bit agreement with the reference (Qwix 0.1.8) on the fixtures of make_golden.py.

Each case runs twice: with the backend's default arithmetic and with ÷ and √ forced through
float64, the route taken on GPUs (numerics, "Division off the CPU"), so CI on a CPU checks that
route's arithmetic (a GPU's own rounding elsewhere is measured by device_parity.py).
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from qmill.engine import numerics, qarray

_FILE = pathlib.Path(__file__).parent / "golden" / "cases.npz"
_DATA = np.load(_FILE)
_META = json.loads(str(_DATA["meta"]))


def _from_bits(bits: np.ndarray, dtype: str) -> np.ndarray:
    return bits.view(jnp.dtype(dtype))


def _case_id(case: dict) -> str:
    tiled = ",".join(f"{a}:{t}" for a, t in case["tiled_axes"])
    extra = "-noise" if case["noise"] else ""
    extra += f"-s{case['scale_dtype']}" if case["scale_dtype"] else ""
    return (
        f"{case['id']}-{case['qtype']}-{case['dtype']}-{case['calibration_method']}"
        f"-cw{case['channelwise_axes']}-t{tiled}{extra}"
    )


def test_fixture_is_small() -> None:
    assert _FILE.stat().st_size < 2_000_000
    assert len(_META) > 100


@pytest.fixture(scope="module", params=["default", "float64"])
def arithmetic(request: pytest.FixtureRequest):
    with numerics.float64_arithmetic(True if request.param == "float64" else None):
        yield


@pytest.mark.parametrize("case", _META, ids=_case_id)
def test_matches_reference_bit_for_bit(case: dict, arithmetic: None) -> None:
    p = f"c{case['id']}/"
    x = jnp.asarray(_from_bits(_DATA[p + "x"], case["dtype"]))
    noise_fn = None
    if case["noise"]:
        noise = jnp.asarray(_DATA[p + "noise"])
        noise_fn = lambda shape: noise.reshape(shape)  # noqa: E731
    how = qarray.HowToQuantize(
        qtype=case["qtype"],
        channelwise_axes=tuple(case["channelwise_axes"]),
        tiled_axes={a: t for a, t in case["tiled_axes"]},
        calibration_method=case["calibration_method"],
        noise_fn=noise_fn,
    )
    q = qarray.quantize(x, how, scale_dtype=case["scale_dtype"])

    assert q.qvalue.dtype == jnp.dtype(case["qvalue_dtype"])
    assert q.scale.dtype == jnp.dtype(case["scale_dtype_out"])
    np.testing.assert_array_equal(
        np.asarray(q.scale), _from_bits(_DATA[p + "scale"], case["scale_dtype_out"])
    )
    np.testing.assert_array_equal(np.asarray(q.qvalue).astype(np.float32), _DATA[p + "qvalue"])
    if p + "zero_point" in _DATA:
        assert q.zero_point is not None
        np.testing.assert_array_equal(
            np.asarray(q.zero_point).astype(np.int32), _DATA[p + "zero_point"]
        )
    else:
        assert q.zero_point is None
    deq = np.asarray(qarray.dequantize(q))
    assert deq.dtype == np.dtype(jnp.dtype(case["dequantized_dtype"]))
    expected = _from_bits(_DATA[p + "dequantized"], case["dequantized_dtype"])
    np.testing.assert_array_equal(deq.view(expected.dtype), expected)
