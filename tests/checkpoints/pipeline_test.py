"""The checkpoint pipeline's pure helpers (its runs are tested in resume_test.py)."""

from qmill.checkpoints import pipeline


def test_default_convention_follows_the_format():
    assert pipeline.with_default_convention({"rules": []}, "safetensors")["convention"] == "torch"
    assert pipeline.with_default_convention({"rules": []}, "orbax")["convention"] == "flax"
    assert (
        pipeline.with_default_convention({"convention": "flax"}, "safetensors")["convention"]
        == "flax"
    )
