"""`--dry-run`'s plan: per tensor the qtype, tiling, kept reason and bytes a real run reports."""

from __future__ import annotations

import collections
import dataclasses
import json

import pytest

from qmill.checkpoints.formats import examples
from qmill.checkpoints.formats.compressed_tensors import schemes as ct_schemes
from qmill.checkpoints.formats.compressed_tensors import writer as ct_writer
from qmill.checkpoints.run import embedded, pipeline, plan
from qmill.cli import main
from tests.checkpoints.llama import write_llama

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


class _Counted:
    """A function that counts its calls by their first argument's key."""

    def __init__(self, function, key=lambda *args: "") -> None:
        self.function, self.key, self.calls = function, key, collections.Counter()

    def __call__(self, *args, **kwargs):
        self.calls[self.key(*args)] += 1
        return self.function(*args, **kwargs)


@pytest.mark.parametrize("scheme", ["W4A16", "NVFP4A16", "FP8_BLOCK"])
def test_a_run_reads_its_recipe_once(tmp_path, monkeypatch, scheme):
    # One `qmill quantize --recipe SCHEME` of a Hugging Face folder, from the command line to the
    # written folder: the scheme found, the recipe read into the engine's rules and the source
    # checked once, and each tensor planned once (the in-process engine quantizes with the
    # plan's LeafPlans; compressed-tensors' writer takes the plan's scheme and global scales).
    from qmill.engine.modelfree import layout, recipes

    folder = write_llama(tmp_path / "llama")
    counted = {
        "scheme_of_recipe": (ct_schemes, _Counted(ct_schemes.scheme_of_recipe)),
        "recipe_from_mapping": (recipes, _Counted(recipes.recipe_from_mapping)),
        "check_source": (ct_writer, _Counted(ct_writer.check_source)),
        "plan_leaf": (layout, _Counted(layout.plan_leaf, key=lambda path, *_: path)),
    }
    for name, (module, wrapper) in counted.items():
        monkeypatch.setattr(module, name, wrapper)
    out = tmp_path / "out"
    assert main.main(["quantize", str(folder), "-o", str(out), "--recipe", scheme, "-q"]) == 0
    assert (out / "config.json").is_file()
    for name in ("scheme_of_recipe", "recipe_from_mapping", "check_source"):
        assert counted[name][1].calls == {"": 1}, name
    tensors = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert counted["plan_leaf"][1].calls == dict.fromkeys(tensors, 1)  # all bf16: each once
