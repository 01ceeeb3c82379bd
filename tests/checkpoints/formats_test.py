"""Format detection, the errors users see, and the import rule (no jax until Orbax is used)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from qmill import checkpoints
from qmill.checkpoints.formats import examples
from qmill.checkpoints.formats import registry as formats

ACCEPTED = "Orbax PyTree checkpoint directory, a .safetensors file, a sharded safetensors set"


@pytest.mark.parametrize(
    ("fmt", "name"), [("orbax", "o"), ("safetensors", "s.safetensors"), ("npz", "n.npz")]
)
def test_each_format_is_detected(tmp_path, fmt, name):
    examples.write_example_checkpoint(tmp_path / name, fmt)
    with checkpoints.open_source(tmp_path / name) as source:
        assert source.format == fmt
        assert source.separator == ("." if fmt == "safetensors" else "/")


def test_files_without_a_telling_suffix_are_sniffed(tmp_path):
    examples.write_example_checkpoint(tmp_path / "s.safetensors", "safetensors")
    examples.write_example_checkpoint(tmp_path / "n.npz", "npz")
    shutil.move(tmp_path / "s.safetensors", tmp_path / "weights.bin")
    shutil.move(tmp_path / "n.npz", tmp_path / "arrays.data")
    with checkpoints.open_source(tmp_path / "weights.bin") as source:
        assert source.format == "safetensors"
    with checkpoints.open_source(tmp_path / "arrays.data") as source:
        assert source.format == "npz"


def test_unknown_inputs_name_the_accepted_formats(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"1234")
    with pytest.raises(ValueError, match=ACCEPTED):
        checkpoints.open_source(tmp_path / "x.bin")
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match=ACCEPTED):
        checkpoints.open_source(tmp_path / "dir")
    with pytest.raises(FileNotFoundError, match="missing"):
        checkpoints.open_source(tmp_path / "missing")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match=r"not an \.npz archive"):
        checkpoints.open_source(tmp_path / "bad.npz")
    for name in ("a", "b"):
        (tmp_path / "dir" / f"{name}.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match="several safetensors indexes"):
        checkpoints.open_source(tmp_path / "dir")


def test_unknown_output_formats_and_misplaced_options_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"unknown checkpoint format 'pickle'.*orbax, safetensors"):
        checkpoints.create_writer(tmp_path / "o", "pickle")
    with pytest.raises(ValueError, match="max_shard_bytes"):
        checkpoints.create_writer(tmp_path / "o", "npz", max_shard_bytes=10)
    assert list(tmp_path.iterdir()) == []


def test_entries_describe_tensors_without_reading_them(tmp_path):
    examples.write_example_checkpoint(tmp_path / "n.npz", "npz")
    with checkpoints.open_source(tmp_path / "n.npz") as source:
        entry = {e.path: e for e in source.entries()}["params/Dense_0/kernel"]
    assert entry == checkpoints.TensorEntry(
        "params/Dense_0/kernel", np.dtype("bfloat16"), (64, 128), 64 * 128 * 2
    )


def test_importing_checkpoints_does_not_import_jax_or_orbax():
    code = (
        "import sys; import qmill.checkpoints, qmill.checkpoints.formats.examples; "
        "sys.exit(1 if 'jax' in sys.modules or 'orbax' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize(
    ("name", "expected"),
    [("out.npz", "npz"), ("out.safetensors", "safetensors"), ("out", "orbax"), ("o.ckpt", "orbax")],
)
def test_an_outputs_suffix_picks_its_format_else_the_sources(name, expected):
    assert checkpoints.format_for_destination(f"/some/dir/{name}", "orbax") == expected
    # A suffix-less name keeps whatever the source is.
    if expected == "orbax":
        assert checkpoints.format_for_destination(name, "npz") == "npz"


def test_a_fifo_is_refused_before_anything_reads_from_it(tmp_path):
    # Reading a FIFO blocks until a writer appears: it wedged the server's one job runner.
    for name in ("model.safetensors", "params.npz", "checkpoint"):
        fifo = tmp_path / name
        os.mkfifo(fifo)
        with pytest.raises(ValueError, match="FIFO"):
            checkpoints.open_source(fifo)
    shards = tmp_path / "shards"
    shards.mkdir()
    os.mkfifo(shards / "model.safetensors")
    with pytest.raises(ValueError, match="FIFO"):
        checkpoints.open_source(shards)


def test_a_hub_id_and_pickled_weights_get_the_way_out(tmp_path, monkeypatch):
    # A Hub id used to get only "does not exist"; a pytorch_model.bin folder only "a directory
    # without a checkpoint qmill reads".
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"hf download meta-llama/Llama-3\.1-8B"):
        formats.open_source("meta-llama/Llama-3.1-8B")
    with pytest.raises(FileNotFoundError) as e:
        formats.open_source("./nothere")
    assert "Hub" not in str(e.value)
    folder = tmp_path / "torch-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"PK\x03\x04 a pickle, never opened")
    for path in (folder, folder / "pytorch_model.bin"):
        with pytest.raises(ValueError, match=r"pytorch_model\.bin.*convert them to safetensors"):
            formats.open_source(path)
