"""Hugging Face model folders in and out: every other file byte for byte, shards and index under
their own names, config.json with a quantization_config; and the output-side guards."""

from __future__ import annotations

import json
import os
import pathlib

import numpy as np
import pytest
import safetensors.numpy

from qmill.checkpoints.base import staging
from qmill.checkpoints.formats import config_summary
from qmill.checkpoints.formats import registry as formats
from qmill.checkpoints.formats.hf_folder import folder as hf_folder
from qmill.checkpoints.run import embedded, pipeline
from tests.checkpoints import llama

CONFIG = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 32, "z": [1, 2]}


def _hf_folder(root: pathlib.Path, *, sharded: bool) -> pathlib.Path:
    """A small HF-style folder: config, tokenizer files, a sub-folder, a symlink, an other-format
    copy of the weights, and safetensors weights (two shards and an index, or one file)."""
    folder = root / "tiny-bert"
    (folder / "1_Pooling").mkdir(parents=True)
    # Not sorted, with unicode: the rewritten config must keep key order and text as they were.
    (folder / "config.json").write_text(json.dumps({**CONFIG, "name": "tïny"}, indent=2))
    (folder / "tokenizer.json").write_bytes(os.urandom(3000))
    (folder / "vocab.txt").write_text("[PAD]\n[UNK]\nhello\n")
    (folder / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    (folder / "README.md").symlink_to(root / "readme-blob")
    (root / "readme-blob").write_text("# tiny\n")
    (folder / "pytorch_model.bin").write_bytes(b"float weights in torch's format")
    rng = np.random.default_rng(0)
    shards = [
        {
            "embeddings.word_embeddings.weight": rng.normal(size=(64, 32)).astype(np.float32),
            "embeddings.LayerNorm.weight": np.ones(32, np.float32),
        },
        {
            "encoder.layer.0.attention.self.query.weight": rng.normal(size=(32, 32)).astype(
                np.float32
            ),
            "encoder.layer.0.attention.self.query.bias": np.zeros(32, np.float32),
            "position_ids": np.arange(16, dtype=np.int64)[None],
        },
    ]
    if not sharded:
        merged = {k: v for shard in shards for k, v in shard.items()}
        safetensors.numpy.save_file(merged, folder / "model.safetensors", {"format": "pt"})
        return folder
    llama.write_shards(folder, shards)
    return folder


def _quantize(source: pathlib.Path, dest: pathlib.Path, recipe: str = "int8", **kw):
    recipes = {
        "int8": {"rules": [{"path_regex": ".*", "qtype": "int8"}]},
        "int4": {"rules": [{"qtype": "int4", "tile_size": 16, "tile_if_divisible": True}]},
    }
    return pipeline.quantize_checkpoint(
        source, dest, recipes[recipe], backend=embedded.EmbeddedClient(), **kw
    )


def _tree(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("sharded", [True, False])
def test_a_folder_comes_out_as_the_same_folder(tmp_path, sharded):
    source = _hf_folder(tmp_path, sharded=sharded)
    out = tmp_path / "tiny-bert-int4"
    rows = _quantize(source, out, "int4")
    before, after = _tree(source), _tree(out)
    weights = {n for n in before if n.endswith(".safetensors") or n.endswith(".index.json")}
    # Same names; every file but the weights and config.json byte for byte; the other-format
    # weights left out (they would ship the float model again).
    assert set(after) == set(before) - {"pytorch_model.bin"}
    for name in set(before) - weights - {"config.json", "pytorch_model.bin"}:
        assert after[name] == before[name], name
    config = json.loads(after["config.json"])
    assert {k: config[k] for k in [*CONFIG, "name"]} == {**CONFIG, "name": "tïny"}
    assert list(config)[: len(CONFIG)] == list(CONFIG)  # key order kept
    qc = config["quantization_config"]
    assert qc["quant_method"] == "qmill" and qc["format"] == "qmill-ptq"
    weights_cfg = qc["config_groups"]["group_0"]["weights"]
    assert weights_cfg["num_bits"] == 4 and weights_cfg["type"] == "int"
    assert weights_cfg["strategy"] == "group" and weights_cfg["group_size"] == 16
    # `qmill inspect` says it in words, not in the schema's (not "int4 group group_size 16").
    assert config_summary.describe(config) == (
        "quantized (qmill): int4 in groups of 16 (per channel where that does not divide) on re:.*"
    )
    assert qc["qmill"]["recipe"]["convention"] == "torch"
    assert qc["qmill"]["quantized_tensors"] == sum(r.qtype != "kept" for r in rows) == 2
    assert qc["qmill"]["not_copied"] == ["pytorch_model.bin"]
    # Weights: the quantized layout, each tensor in the shard its source tensor was in.
    with formats.open_source(out) as written, formats.open_source(source) as original:
        assert isinstance(written, hf_folder.HfFolderSource)
        keys = {e.path for e in written.entries()}
        for entry in original.entries():
            quantized = any(k.startswith(entry.path) and "array" in k for k in keys)
            if quantized:
                origin = original.weights.shard_of(entry.path)
                held = [k for k in keys if k.startswith(entry.path) and "qvalue" in k]
                assert [written.weights.shard_of(k) for k in held] == [origin]
            else:
                np.testing.assert_array_equal(written.read(entry.path), original.read(entry.path))
    if sharded:
        index = json.loads(after["model.safetensors.index.json"])
        assert set(index["weight_map"].values()) == {
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_ignore_lists_every_kept_float_weight_whatever_its_float_type(tmp_path, dtype):
    """bfloat16 is most models' dtype; numpy's own float check does not count it a float."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    rng = np.random.default_rng(0)
    with formats.create_writer(folder / "model.safetensors", "safetensors") as writer:
        for name in ("embed.weight", "query.weight"):
            writer.write(name, rng.normal(size=(32, 32)).astype(dtype))
        writer.write("norm.weight", np.ones(32, dtype))
    out = tmp_path / "out"
    recipe = {"rules": [{"path_regex": "query.*", "qtype": "int8"}]}
    pipeline.quantize_checkpoint(folder, out, recipe, backend=embedded.EmbeddedClient())
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["embed.weight"] and qc["qmill"]["quantized_tensors"] == 1


def test_an_already_quantized_folder_is_refused(tmp_path):
    source = _hf_folder(tmp_path, sharded=False)
    once = tmp_path / "once"
    _quantize(source, once)
    with pytest.raises(ValueError, match="already quantized"):
        _quantize(once, tmp_path / "twice")
    assert not (tmp_path / "twice").exists()


def test_a_folder_written_as_one_file_or_npz_is_just_the_weights(tmp_path):
    source = _hf_folder(tmp_path, sharded=True)
    _quantize(source, tmp_path / "w.npz")
    with formats.open_source(tmp_path / "w.npz") as written:
        assert written.format == "npz"
        assert "encoder.layer.0.attention.self.query.weight" in {
            e.path.split("/array/")[0] for e in written.entries()
        }


class _WithStats:
    """The embedded backend with a calibration's statistics, as `qmill quantize --calibration
    STATS.npz` gives them."""

    def __init__(self, stats):
        self._backend, self._stats = embedded.EmbeddedClient(), stats

    def quantize(self, recipe, tensors, **kw):
        return self._backend.quantize(recipe, tensors, calibration_stats=self._stats, **kw)


def test_an_awq_folder_keeps_the_awq_scale_beside_the_codes(tmp_path):
    from qmill import checkpoints
    from qmill.engine.contrib import leaf as contrib_leaf
    from qmill.engine.modelfree import layout, recipes

    source = _hf_folder(tmp_path, sharded=True)
    weight = "encoder.layer.0.attention.self.query.weight"  # (out, in): 32 input channels
    act = np.abs(np.random.default_rng(1).normal(size=32)).astype(np.float32) + 0.1
    stats = {f"{weight}_awq/count": np.int32(2), f"{weight}_awq/sum_of_act_scale": 2 * act}
    recipe = {"rules": [{"path_regex": ".*", "qtype": "int8"}]}
    out = tmp_path / "awq-bert"
    pipeline.quantize_checkpoint(source, out, recipe, backend=_WithStats(stats))
    tree = checkpoints.load(out)
    assert set(tree[weight]) == {"array", "awq_scale"}
    shard = safetensors.numpy.load_file(out / "model-00002-of-00002.safetensors")
    assert f"{weight}/awq_scale" in shard  # in its weight's own shard
    # The same bits as the engine's leaf for that tensor and statistic.
    array = np.asarray(
        safetensors.numpy.load_file(source / "model-00002-of-00002.safetensors")[weight]
    )
    plan = layout.plan_leaf(weight, array.shape, array.dtype, recipes.recipe_from_mapping(recipe))
    expected = contrib_leaf.quantizer(contrib_leaf.method_stats(stats))(array, plan)
    np.testing.assert_array_equal(tree[weight]["awq_scale"], expected.beside["awq_scale"])
    np.testing.assert_array_equal(tree[weight]["array"]["qvalue"], expected.codes())
    np.testing.assert_array_equal(tree[weight]["array"]["scale"], expected.scale)
    # The other weights had no statistics: plain PTQ, nothing beside.
    assert set(tree["embeddings.word_embeddings.weight"]) == {"array"}
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["qmill"]["beside_array"] == {"awq_scale": 1}


@pytest.mark.parametrize("where", ["same", "inside"])
def test_an_output_that_is_the_source_or_inside_it_is_refused(tmp_path, where):
    source = _hf_folder(tmp_path, sharded=False)
    before = _tree(source)
    dest = source if where == "same" else source / "quantized"
    with pytest.raises(ValueError, match="destroy the source"):
        _quantize(source, dest, overwrite=True)
    assert _tree(source) == before


def test_overwriting_an_output_that_holds_the_source_is_refused(tmp_path):
    source = _hf_folder(tmp_path, sharded=False)
    with pytest.raises(ValueError, match="--overwrite would delete it"):
        _quantize(source, tmp_path, overwrite=True)
    assert (source / "model.safetensors").is_file()


@pytest.mark.parametrize("name", ["out.pt", "model.bin", "weights.h5", "x.gguf"])
def test_an_output_suffix_qmill_does_not_write_is_refused(tmp_path, name):
    source = _hf_folder(tmp_path, sharded=False)
    with pytest.raises(ValueError, match=r"\.safetensors or \*\.npz.*--format"):
        _quantize(source, tmp_path / name)
    assert not (tmp_path / name).exists()
    assert not list(tmp_path.glob(f"{name}*"))
    # Named on purpose, the name is written.
    _quantize(source, tmp_path / name, output_format="npz")
    assert (tmp_path / name).is_file()


def test_a_run_that_fails_before_any_tensor_leaves_no_partial_output(tmp_path):
    source = _hf_folder(tmp_path, sharded=False)

    class Unreachable:
        def quantize(self, recipe, tensors, **_):
            raise ConnectionError("server never reached")
            yield  # pragma: no cover - a generator, as every backend

    dest = tmp_path / "out"
    with pytest.raises(ConnectionError):
        pipeline.quantize_checkpoint(
            source, dest, {"rules": [{"qtype": "int8"}]}, backend=Unreachable()
        )
    assert not dest.exists()
    assert not dest.with_name(dest.name + staging.PARTIAL_SUFFIX).exists()
