"""`--dry-run`'s plan: per tensor the qtype, tiling, kept reason and bytes a real run reports."""

from __future__ import annotations

import dataclasses

import pytest

from qmill.checkpoints.formats import examples
from qmill.checkpoints.run import embedded, pipeline, plan

RECIPES = {
    "int8": {"rules": [{"qtype": "int8"}]},
    "int4 tiles": {"rules": [{"qtype": "int4", "tile_size": 32, "tile_if_divisible": True}]},
    "minmax (zero points), a skip": {
        "rules": [
            {"path_regex": ".*embedding", "skip": True},
            {"qtype": "int8", "calibration_method": "minmax", "scale_dtype": "float32"},
        ]
    },
    "nf4": {"rules": [{"qtype": "nf4", "tile_size": 64, "tile_if_divisible": True}]},
    "mxfp4, vectors too": {
        # The conv's tile axis (8) can't take mxfp4's tile: it is left to no rule, kept.
        "rules": [{"path_regex": ".*(Dense|Embed).*", "qtype": "mxfp4", "tile_size": 32,
                   "include_vectors": True}]
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "src.safetensors"
    examples.write_example_checkpoint(path, "safetensors")
    return path


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_plan_is_what_a_run_reports_without_sqnr(tmp_path, source, name):
    planned = plan.plan_checkpoint(source, RECIPES[name])
    ran = pipeline.quantize_checkpoint(
        source, tmp_path / "out.npz", RECIPES[name], backend=embedded.EmbeddedClient()
    )
    assert [r.path for r in planned] == [r.path for r in ran]
    # Everything but the measured quality (NaN in a plan: one NaN object for all of them, so
    # that == compares the rest).
    nan = planned[0].sqnr_db
    assert nan != nan  # a plan measures nothing
    unmeasured = dict.fromkeys(
        ("sqnr_db", "mean_relative_error", "output_sqnr_db", "rtn_output_sqnr_db"), nan
    )
    for p, r in zip(planned, ran, strict=True):
        assert dataclasses.replace(p, **unmeasured) == dataclasses.replace(r, **unmeasured)
    assert any(r.qtype != "kept" for r in planned)
    assert not list(tmp_path.glob("*.qmill-partial"))


def test_a_plan_refuses_what_the_run_would(source):
    bad = {"rules": [{"qtype": "int4", "tile_size": 7}]}  # divides no axis of the example
    with pytest.raises(ValueError, match="tile size 7 does not divide"):
        plan.plan_checkpoint(source, bad)
