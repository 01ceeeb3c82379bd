"""Flags of a language-model calibration that would do nothing are refused, not ignored."""

from __future__ import annotations

import pytest

from qmill.cli import calibrated_lm
from qmill.cli import main as cli


def _args(*flags: str):
    return cli._parser("quantize").parse_args(["quantize", "folder", "-o", "out", *flags])


def test_all_experts_without_a_calibration_is_refused():
    with pytest.raises(ValueError, match=r"--calibrate-all-experts .* add --method gptq"):
        calibrated_lm.wanted(_args("--recipe", "W4A16", "--calibrate-all-experts"))
    # With a method it is a calibration's option; without any of it, no calibration at all.
    assert calibrated_lm.wanted(
        _args("--method", "gptq", "--calibration-ids", "ids.npy", "--calibrate-all-experts")
    )
    assert not calibrated_lm.wanted(_args("--recipe", "W4A16"))


def test_no_awq_clip_is_for_awq_alone():
    ids = ("--calibration-ids", "ids.npy")
    assert calibrated_lm.wanted(_args("--method", "awq", *ids, "--no-awq-clip"))
    assert _args("--method", "awq", *ids, "--no-awq-clip").awq_clip is False
    assert _args("--method", "awq", *ids).awq_clip is True
    for method in (("--method", "awq+gptq", *ids), ("--method", "gptq", *ids), ()):
        with pytest.raises(ValueError, match=r"--no-awq-clip .* clips nothing: drop the flag"):
            calibrated_lm.wanted(_args("--recipe", "W4A16", *method, "--no-awq-clip"))


def test_qep_correction_is_for_qep_alone():
    ids = ("--calibration-ids", "ids.npy")
    assert calibrated_lm.wanted(_args("--method", "qep", *ids, "--qep-correction", "0.3"))
    assert _args("--method", "qep", *ids).qep_correction is None  # the request's 0.5
    for method in (("--method", "gptq", *ids), ("--method", "awq", *ids), ()):
        with pytest.raises(ValueError, match=r"--qep-correction is --method qep's"):
            calibrated_lm.wanted(_args("--recipe", "W4A16", *method, "--qep-correction", "1"))


def test_hadamard_seed_is_for_the_rotation_alone():
    ids = ("--calibration-ids", "ids.npy")
    for method in ("hadamard", "hadamard+gptq"):
        assert calibrated_lm.wanted(_args("--method", method, *ids, "--hadamard-seed", "3"))
    assert _args("--method", "hadamard", *ids).hadamard_seed is None  # the request's 0
    for method in (("--method", "gptq", *ids), ("--method", "awq", *ids), ()):
        with pytest.raises(ValueError, match=r"--hadamard-seed is --method hadamard's"):
            calibrated_lm.wanted(_args("--recipe", "W4A16", *method, "--hadamard-seed", "1"))
