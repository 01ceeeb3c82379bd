"""Calibration methods: parsing and hand-computed values."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from qmill.engine import calibration

X = jnp.array([[1.0, -4.0, 2.0, 0.5], [3.0, 1.0, -1.0, -2.0]], jnp.float32)


def test_absmax_channelwise_and_factor() -> None:
    np.testing.assert_array_equal(
        calibration.calibrate(X, "absmax", (1, 4))["absmax"], [[4.0], [3.0]]
    )
    np.testing.assert_array_equal(
        calibration.calibrate(X, "absmax,0.5", (1, 4))["absmax"], [[2.0], [1.5]]
    )


def test_absmax_tiled_and_per_tensor() -> None:
    np.testing.assert_array_equal(
        calibration.calibrate(X, "absmax", (1, 2))["absmax"], [[4.0, 2.0], [3.0, 2.0]]
    )
    np.testing.assert_array_equal(calibration.calibrate(X, "absmax", (2, 4))["absmax"], [[4.0]])
    np.testing.assert_array_equal(
        calibration.calibrate(X, "absmax", (2, 2))["absmax"], [[4.0, 2.0]]
    )


def test_minmax_clips_to_contain_zero() -> None:
    x = jnp.array([[1.0, 2.0], [-3.0, -1.0]], jnp.float32)
    c = calibration.calibrate(x, "MinMax", (1, 2))
    np.testing.assert_array_equal(c["min"], [[0.0], [-3.0]])
    np.testing.assert_array_equal(c["max"], [[2.0], [0.0]])
    c = calibration.calibrate(x, "minmax,2", (1, 2))
    np.testing.assert_array_equal(c["min"], [[0.0], [-6.0]])


def test_rms() -> None:
    x = jnp.array([[3.0, -4.0, 0.0, 0.0]], jnp.float32)  # mean(x²) = 6.25
    np.testing.assert_allclose(calibration.calibrate(x, "rms,2", (1, 4))["absmax"], [[5.0]])


def test_fixed_ranges() -> None:
    c = calibration.calibrate(X, "fixed,-3,3", (1, 4))
    assert set(c) == {"absmax"} and c["absmax"].shape == (1, 1) and float(c["absmax"][0, 0]) == 3.0
    c = calibration.calibrate(X, "fixed,2.5", (1, 4))
    assert float(c["absmax"][0, 0]) == 2.5
    c = calibration.calibrate(X.astype(jnp.bfloat16), "fixed,-2,6", (1, 4))
    assert c["min"].dtype == jnp.bfloat16
    assert (float(c["min"][0, 0]), float(c["max"][0, 0])) == (-2.0, 6.0)


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("median", "unknown calibration method 'median'"),
        ("rms", "rms takes 1 argument"),
        ("absmax,1,2", "absmax takes 0 or 1"),
        ("fixed,1,-1", "must be non-empty and contain 0"),
        ("fixed,1,3", "contain 0"),
        ("absmax,abc", "must be numbers"),
    ],
)
def test_bad_methods(method: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        calibration.parse(method)


def test_parse_symmetry() -> None:
    assert calibration.parse("fixed,-2,2").symmetric
    assert not calibration.parse("fixed,-1,3").symmetric
    assert not calibration.parse("minmax").symmetric
    assert calibration.parse("rms,3").symmetric


@pytest.mark.parametrize(
    "method",
    ["fixed,-inf,inf", "fixed,nan", "absmax,1e400", "absmax,inf", "absmax,nan", "rms,nan"],
)
def test_non_finite_arguments_are_refused(method):
    # They made all-NaN scales and all-zero codes with exit status 0.
    with pytest.raises(ValueError, match="finite"):
        calibration.parse(method)


@pytest.mark.parametrize("method", ["absmax,0", "absmax,-1", "minmax,0", "rms,0", "rms,-2"])
def test_factors_must_be_positive(method):
    # They gave scale 1 whatever the tensor (SQNR 10.8 dB instead of 44.2).
    with pytest.raises(ValueError, match="must be positive"):
        calibration.parse(method)
