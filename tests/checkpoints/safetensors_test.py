"""safetensors: compatibility with the reference library, sharded sets in and out, bad files."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy

from qmill import checkpoints
from qmill.checkpoints.formats.safetensors import writer as safetensors_writer


def _hf_sharded(tmp_path, sample, shards=3, per_shard=2):
    """A sharded set as Hugging Face writes one: shards by the reference library + an index."""
    src = tmp_path / "hf"
    src.mkdir()
    weight_map = {}
    for shard in range(shards):
        name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for i in range(per_shard):
            key = f"model.layers.{shard * per_shard + i}.mlp.up_proj.weight"
            tensors[key] = sample(np.float32, (8, 4), shard * per_shard + i)
            weight_map[key] = name
        safetensors.numpy.save_file(tensors, src / name, metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return src


def test_output_opens_with_the_reference_library(tmp_path, sample):
    dest = tmp_path / "out.safetensors"
    weight = sample(np.float32, (4, 3))
    qvalue = sample(ml_dtypes.int4, (3, 3))
    with checkpoints.create_writer(dest, "safetensors") as writer:
        writer.write("w", weight)
        writer.write("step", np.array(5, np.int64))
        writer.write_quantized("l.weight", {"qvalue": qvalue, "scale": np.ones((3, 1))})
        writer.write("bf16", sample(ml_dtypes.bfloat16, (2,)))
    with safetensors.safe_open(dest, "np") as f:
        assert set(f.keys()) == {
            "w",
            "step",
            "l.weight/array/qvalue",
            "l.weight/array/scale",
            "bf16",
        }
        assert f.get_tensor("w").tobytes() == weight.tobytes()
        assert f.get_tensor("step").shape == ()
        # int4 is packed two codes per byte (9 codes, 5 bytes); its logical dtype and shape are
        # in the metadata.
        packed = f.get_tensor("l.weight/array/qvalue")
        assert packed.dtype == np.uint8 and packed.shape == (5,)
        codes = qvalue.astype(np.int8).view(np.uint8).reshape(-1) & 0x0F
        assert packed[0] == codes[0] | codes[1] << 4 and packed[4] == codes[8]
        assert json.loads(f.metadata()["qmill.dtypes"]) == {"l.weight/array/qvalue": "int4"}
        assert json.loads(f.metadata()["qmill.packed"]) == {"l.weight/array/qvalue": [3, 3]}
    with checkpoints.open_source(dest) as source:
        assert [e.path for e in source.entries()] == [
            "w",
            "step",
            "l.weight/array/qvalue",
            "l.weight/array/scale",
            "bf16",
        ]
        assert source.entries()[2].shape == (3, 3)
        back = source.read("l.weight/array/qvalue")
        assert back.dtype == ml_dtypes.int4 and back.tobytes() == qvalue.tobytes()


def test_reads_a_hugging_face_sharded_set_in_shard_then_file_order(tmp_path, sample):
    src = _hf_sharded(tmp_path, sample)
    for path in (src, src / "model.safetensors.index.json"):
        with checkpoints.open_source(path) as source:
            assert source.format == "safetensors" and source.separator == "."
            paths = [e.path for e in source.entries()]
            assert paths == [f"model.layers.{i}.mlp.up_proj.weight" for i in range(6)]
            got = source.read("model.layers.4.mlp.up_proj.weight")
            assert got.tobytes() == sample(np.float32, (8, 4), 4).tobytes()


def test_sharded_input_gives_sharded_output_with_an_index(tmp_path, sample):
    src = _hf_sharded(tmp_path, sample)
    out = tmp_path / "out"
    with (
        checkpoints.open_source(src) as source,
        checkpoints.create_writer(out, "safetensors", like=source) as writer,
    ):
        # Results arrive out of order, as they do from a server.
        for e in reversed(source.entries()):
            writer.write_quantized(
                e.path,
                {"qvalue": np.zeros(e.shape, np.int8), "scale": np.ones((8, 1), np.float32)},
            )
    names = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(p.name for p in out.iterdir()) == [*names, "model.safetensors.index.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert len(weight_map) == 12
    for i in range(6):
        for part in ("qvalue", "scale"):
            assert weight_map[f"model.layers.{i}.mlp.up_proj.weight/array/{part}"] == names[i // 2]
    assert index["metadata"]["total_size"] == 6 * (32 + 32)
    for name in names:
        with safetensors.safe_open(out / name, "np") as f:
            assert len(f.keys()) == 4
            assert f.metadata() == {"format": "pt"}  # carried over from the input
    with checkpoints.open_source(out) as back:
        assert len(back.entries()) == 12


def test_a_directory_of_safetensors_files_without_index_is_one_set(tmp_path, sample):
    src = tmp_path / "set"
    src.mkdir()
    for i in range(2):
        safetensors.numpy.save_file(
            {f"t{i}": sample(np.float32, (2,), i)}, src / f"p{i}.safetensors"
        )
    with checkpoints.open_source(src) as source:
        assert [e.path for e in source.entries()] == ["t0", "t1"]
        with checkpoints.create_writer(tmp_path / "out", "safetensors", like=source) as writer:
            for e in source.entries():
                writer.write(e.path, source.read(e.path))
    weight_map = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert weight_map["weight_map"] == {
        "t0": "model-00001-of-00002.safetensors",
        "t1": "model-00002-of-00002.safetensors",
    }


def test_max_shard_bytes_cuts_shards_and_a_plain_directory_holds_model_safetensors(tmp_path):
    with checkpoints.create_writer(tmp_path / "cut", "safetensors", max_shard_bytes=100) as w:
        for i in range(5):
            w.write(f"t{i}", np.zeros(16, np.float32))  # 64 bytes: one per shard
    index = json.loads((tmp_path / "cut" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        f"model-{i:05d}-of-00005.safetensors" for i in range(1, 6)
    ]
    with checkpoints.create_writer(tmp_path / "plain", "safetensors") as w:
        w.write("t", np.zeros(3, np.float32))
    assert [p.name for p in (tmp_path / "plain").iterdir()] == ["model.safetensors"]
    with pytest.raises(ValueError, match="directory"):
        checkpoints.create_writer(tmp_path / "x.safetensors", "safetensors", max_shard_bytes=100)


def test_broken_files_and_indexes_are_named(tmp_path, sample):
    good = tmp_path / "good.safetensors"
    safetensors.numpy.save_file({"a": sample(np.float32, (64,))}, good)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-10])
    with pytest.raises(ValueError, match="truncated"):
        checkpoints.open_source(cut)
    (tmp_path / "junk.safetensors").write_bytes(b"\x05" * 20)
    with pytest.raises(ValueError, match="not a safetensors file"):
        checkpoints.open_source(tmp_path / "junk.safetensors")
    header = json.dumps({"x": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}).encode()
    (tmp_path / "f4.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\0")
    with pytest.raises(ValueError, match="dtype F4"):
        checkpoints.open_source(tmp_path / "f4.safetensors")

    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "missing.safetensors"}}))
    with pytest.raises(FileNotFoundError, match=r"missing\.safetensors"):
        checkpoints.open_source(index)
    index.write_text(json.dumps({"weight_map": {"b": "good.safetensors"}}))
    with pytest.raises(ValueError, match="does not hold it"):
        checkpoints.open_source(index)
    index.write_text("[]")
    with pytest.raises(ValueError, match="not a safetensors index"):
        checkpoints.open_source(index)


@pytest.mark.parametrize("reserve_per_entry", [None, 0])
def test_header_space_reserved_from_like_is_used_or_outgrown(
    tmp_path, sample, monkeypatch, reserve_per_entry
):
    src = tmp_path / "in.safetensors"
    tensors = {f"layer.{i}.weight": sample(np.float32, (16, 8), i) for i in range(3)}
    safetensors.numpy.save_file(tensors, src)
    if reserve_per_entry is None:

        def no_copy(*args):
            raise AssertionError("the header fits its reservation: no data copy expected")

        monkeypatch.setattr(safetensors_writer, "_append", no_copy)
    else:  # a reservation too small: the data is copied behind a fresh header instead
        monkeypatch.setattr(safetensors_writer, "_RESERVE_PER_ENTRY", reserve_per_entry)
        monkeypatch.setattr(safetensors_writer, "_RESERVE_SLACK", 8)
    with (
        checkpoints.open_source(src) as source,
        checkpoints.create_writer(tmp_path / "out.safetensors", "safetensors", like=source) as w,
    ):
        for e in source.entries():
            # int4: the header also holds the packed record, which must fit the reservation.
            qvalue = source.read(e.path).clip(-8, 7).astype(ml_dtypes.int4)
            w.write_quantized(e.path, {"qvalue": qvalue, "scale": np.ones(8)})
    with safetensors.safe_open(tmp_path / "out.safetensors", "np") as f:
        assert f.get_tensor("layer.1.weight/array/qvalue").shape == (64,)
        assert len(f.keys()) == 6
    with checkpoints.open_source(tmp_path / "out.safetensors") as back:
        got = back.read("layer.1.weight/array/qvalue")
        assert (
            got.tobytes() == tensors["layer.1.weight"].clip(-8, 7).astype(ml_dtypes.int4).tobytes()
        )


def test_a_shape_whose_byte_count_wraps_64_bits_is_refused(tmp_path):
    # 2^32 x 2^32 float32 is 2^66 bytes: a 64-bit product wraps to 0 and matched offsets [0, 0].
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [2**32, 2**32], "data_offsets": [0, 0]}}
    ).encode()
    path = tmp_path / "huge.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        checkpoints.open_source(path).entries()
