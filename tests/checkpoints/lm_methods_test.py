"""checkpoints/lm/methods.check_recipe: the recipes each calibration method takes, refused
before any work with what runs instead (the in-process run, CalibrateLanguageModel and a job's
SubmitJob all call it: tests/integration/lm_jobs_test.py)."""

from __future__ import annotations

import pytest

from qmill.checkpoints.formats.compressed_tensors import schemes as ct_schemes
from qmill.checkpoints.lm import methods as lm_methods

# Micro-scaled group scales (MX: E8M0; NVFP4: E4M3 under a global scale) and 2-D blocks.
NOT_GPTQ = {"MXFP4", "MXFP4A16", "MXFP8", "MXFP8A16", "NVFP4A16", "FP8_BLOCK"}


def _refusal(method: str, recipe: dict) -> str | None:
    try:
        lm_methods.check_recipe(method, recipe)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("method", lm_methods.METHODS)
def test_each_method_takes_every_scheme_but_what_it_cannot_follow(method):
    refused = {}
    for name, scheme in ct_schemes.SCHEMES.items():
        why = _refusal(method, ct_schemes.recipe_for(scheme))
        if scheme.static_inputs:  # FP8, NVFP4: their input scales take no method at all
            assert why == lm_methods.static_refusal(scheme)
        elif why is not None:
            refused[name] = why
    # A fold or a rotation changes the weights NVFP4's global scales were found from.
    changes = lm_methods.smoothing(method) or lm_methods.rotates(method)
    folded = {"NVFP4A16"} if changes else set()
    assert set(refused) == (NOT_GPTQ if lm_methods.uses_gptq(method) else set()) | folded
    for name, why in refused.items():
        # One line: what cannot be done and why, then what runs instead.
        assert "\n" not in why and f"--method {method} cannot calibrate {name}: " in why
        assert "no --method (round to nearest)" in why
        assert ("E8M0" in why) == name.startswith("MX"), why
        assert ("global scales are found" in why) == (name in folded), why
    takes = lm_methods.gptq_schemes()
    assert "W4A16, W4A16_ASYM, W8A16, W8A8, FP8_DYNAMIC" in takes
    assert not any(name in takes.replace("W4A16_ASYM", "") for name in NOT_GPTQ), takes


def test_a_custom_rule_is_refused_by_its_numerics_not_its_name():
    nvfp4 = {"path_regex": ".*proj.*", "qtype": "nvfp4", "tiled_axes": {1: 16}}
    recipe = {"rules": [{"path_regex": ".*norm.*", "skip": True}, nvfp4]}
    why = _refusal("smoothquant+gptq", recipe)
    assert why is not None and "rule '.*proj.*' (nvfp4)" in why and "E4M3" in why
    assert "--method smoothquant (the fold" in why
    assert _refusal("smoothquant", recipe) is None  # round to nearest after the fold
    int4 = {"rules": [{"path_regex": ".*", "qtype": "int4", "tile_size": 32}]}
    assert _refusal("gptq", int4) is None


def test_rotation_rounded_to_nearest_at_four_bits_comes_with_a_note():
    from qmill.client import recipes

    w4, w8a8 = recipes.load("W4A16"), recipes.load("W8A8")
    (note,) = lm_methods.notices("hadamard", w4)
    assert "4-bit weights" in note and "--method hadamard+gptq" in note
    # What measured well (or is no rotation) has none.
    assert lm_methods.notices("hadamard", w8a8) == []
    assert lm_methods.notices("hadamard+gptq", w4) == []
    assert lm_methods.notices("gptq", w4) == []
