"""A language-model job's calibration options on the wire (cli/lm_jobs.message, the client's side)
read back by the server (server/codec.lm_options) as the request the CLI made."""

from __future__ import annotations

import numpy as np
import pytest

from qmill.checkpoints.lm import calibration as lm_calibration
from qmill.cli import lm_jobs
from qmill.server import codec

IDS = np.arange(24, dtype=np.int32).reshape(3, 8)


@pytest.mark.parametrize("clip", [True, False])
def test_awq_clip_travels_and_the_default_stays_off_the_wire(clip):
    sent = lm_calibration.LmRequest(calibration_ids=IDS, method="awq", awq_grid=4, awq_clip=clip)
    message = lm_jobs.message(sent)
    # Clipping, the default, is a false proto3 bool: a request without it is the message it was.
    assert (message.awq_no_clip, "awq_no_clip" in str(message)) == (not clip, not clip)
    got, gate = codec.lm_options(message)
    assert (got.method, got.awq_grid, got.awq_clip, gate) == ("awq", 4, clip, None)
    assert np.array_equal(got.calibration_ids, IDS)


def test_awq_no_clip_with_another_method_is_refused():
    message = lm_jobs.message(lm_calibration.LmRequest(calibration_ids=IDS, method="awq+gptq"))
    message.awq_no_clip = True
    with pytest.raises(ValueError, match=r"awq_no_clip .* method 'awq\+gptq' clips nothing"):
        codec.lm_options(message)


def test_qep_correction_travels_and_is_refused_with_another_method():
    sent = lm_calibration.LmRequest(calibration_ids=IDS, method="qep", qep_correction=0.25)
    got, _ = codec.lm_options(lm_jobs.message(sent))
    assert (got.method, got.qep_correction) == ("qep", 0.25)
    default = lm_jobs.message(lm_calibration.LmRequest(calibration_ids=IDS, method="qep"))
    default.ClearField("qep_correction")  # an older client's message: the paper's 0.5
    assert codec.lm_options(default)[0].qep_correction == 0.5
    for method, correction, words in (
        ("gptq", 0.5, r"qep_correction is method qep's; method 'gptq' corrects nothing"),
        ("qep", float("nan"), r"qep_correction must be in \[0, 1\], got nan"),
        ("qep", -0.1, r"qep_correction must be in \[0, 1\], got -0.1"),
    ):
        message = lm_jobs.message(lm_calibration.LmRequest(calibration_ids=IDS, method=method))
        message.qep_correction = correction
        with pytest.raises(ValueError, match=words):
            codec.lm_options(message)


def test_the_hadamard_seed_travels_and_is_refused_with_another_method():
    sent = lm_calibration.LmRequest(calibration_ids=IDS, method="hadamard+gptq", hadamard_seed=9)
    got, _ = codec.lm_options(lm_jobs.message(sent))
    assert (got.method, got.hadamard_seed) == ("hadamard+gptq", 9)
    unset = lm_jobs.message(lm_calibration.LmRequest(calibration_ids=IDS, method="hadamard"))
    unset.ClearField("hadamard_seed")
    assert codec.lm_options(unset)[0].hadamard_seed == 0
    message = lm_jobs.message(lm_calibration.LmRequest(calibration_ids=IDS, method="awq"))
    message.hadamard_seed = 1
    with pytest.raises(ValueError, match=r"hadamard_seed is .* method 'awq' rotates nothing"):
        codec.lm_options(message)
