"""Checkpoint readers/writers: every dtype round-trips, outputs are atomic, layouts are Qwix's."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from qmill.client import checkpoints
from qmill.client.checkpoints import examples

DTYPES = [
    np.float32,
    np.float16,
    np.float64,
    ml_dtypes.bfloat16,
    np.int8,
    np.uint8,
    np.int32,
    np.int64,
    np.bool_,
    ml_dtypes.int4,
    ml_dtypes.uint4,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e4m3,
    ml_dtypes.float4_e2m1fn,
]
DESTINATIONS = {"orbax": "ckpt", "safetensors": "ckpt.safetensors", "npz": "ckpt.npz"}


def _sample(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if np.dtype(dtype).name in ("int4", "uint4"):
        lo = -8 if np.dtype(dtype).name == "int4" else 0
        return rng.integers(lo, lo + 16, shape).astype(dtype)
    return rng.normal(0, 2, shape).astype(np.float32).astype(dtype)


@pytest.mark.parametrize("fmt", sorted(DESTINATIONS))
def test_every_dtype_and_scalars_round_trip(tmp_path, fmt):
    tree = {f"t/{np.dtype(d).name}": _sample(d, (3, 5)) for d in DTYPES}
    tree["scalar"] = np.array(7, np.int32)
    dest = tmp_path / DESTINATIONS[fmt]
    with checkpoints.create_writer(dest, fmt) as writer:
        for path, array in tree.items():
            writer.write(path, array)
    with checkpoints.open_source(dest) as source:
        entries = {e.path: e for e in source.entries()}
        assert set(entries) == set(tree)
        for path, array in tree.items():
            back = source.read(path)
            assert entries[path].dtype == array.dtype and entries[path].shape == array.shape
            assert back.dtype == array.dtype and back.shape == array.shape, path
            assert back.tobytes() == array.tobytes(), path


def test_quantized_leaf_loads_as_qwix_layout_with_plain_orbax(tmp_path):
    import orbax.checkpoint as ocp

    qvalue = _sample(ml_dtypes.int4, (4, 6))
    scale = np.ones((1, 6), np.float32)
    with checkpoints.create_writer(tmp_path / "q", "orbax") as writer:
        writer.write_quantized("params/Dense_0/kernel", {"qvalue": qvalue, "scale": scale})
        writer.write("params/Dense_0/bias", np.zeros(6, np.float32))
    restored = ocp.PyTreeCheckpointer().restore(tmp_path / "q")
    kernel = restored["params"]["Dense_0"]["kernel"]["array"]
    assert set(kernel) == {"qvalue", "scale"}
    assert np.asarray(kernel["qvalue"]).tobytes() == qvalue.tobytes()
    assert restored["params"]["Dense_0"]["bias"].shape == (6,)


def test_quantized_safetensors_keys_use_dots(tmp_path):
    dest = tmp_path / "q.safetensors"
    with checkpoints.create_writer(dest, "safetensors") as writer:
        writer.write_quantized(
            "l.weight",
            {
                "qvalue": np.zeros((2, 2), np.int8),
                "scale": np.ones((2, 1), np.float32),
                "zero_point": np.zeros((2, 1), np.int8),
            },
        )
    with checkpoints.open_source(dest) as source:
        assert [e.path for e in source.entries()] == [
            "l.weight.array.qvalue",
            "l.weight.array.scale",
            "l.weight.array.zero_point",
        ]


def _sharded(tmp_path):
    src = tmp_path / "sharded"
    src.mkdir()
    weight_map = {}
    for shard in range(2):
        name = f"model-{shard + 1:05d}-of-00002.safetensors"
        with checkpoints.create_writer(src / name, "safetensors") as writer:
            for i in range(2):
                key = f"layers.{shard * 2 + i}.weight"
                writer.write(key, _sample(np.float32, (4, 4), shard * 2 + i))
                weight_map[key] = name
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return src


def test_sharded_input_gives_sharded_output_with_an_index(tmp_path):
    src = _sharded(tmp_path)
    with checkpoints.open_source(src) as source:
        assert len(source.entries()) == 4
        with checkpoints.create_writer(tmp_path / "out", "safetensors", like=source) as writer:
            for e in source.entries():
                writer.write_quantized(
                    e.path,
                    {"qvalue": np.zeros(e.shape, np.int8), "scale": np.ones((4, 1), np.float32)},
                )
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["layers.3.weight.array.qvalue"] == "model-00002-of-00002.safetensors"
    assert index["weight_map"]["layers.0.weight.array.scale"] == "model-00001-of-00002.safetensors"
    with checkpoints.open_source(tmp_path / "out") as out:
        assert len(out.entries()) == 8


@pytest.mark.parametrize("fmt", sorted(DESTINATIONS))
def test_a_failed_write_leaves_nothing_behind(tmp_path, fmt):
    dest = tmp_path / DESTINATIONS[fmt]
    with pytest.raises(RuntimeError), checkpoints.create_writer(dest, fmt) as writer:
        writer.write("a", np.ones(3, np.float32))
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_existing_destination_is_refused_unless_overwrite(tmp_path):
    examples.write_example_checkpoint(tmp_path / "c", "npz")
    with pytest.raises(FileExistsError, match="--overwrite"):
        examples.write_example_checkpoint(tmp_path / "c", "npz")
    examples.write_example_checkpoint(tmp_path / "c", "npz", seed=1, overwrite=True)
    with checkpoints.open_source(tmp_path / "c") as source:
        got = source.read("params/Dense_1/kernel")
    assert got.tobytes() == examples.example_tree(1)["params/Dense_1/kernel"].tobytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_unknown_inputs_name_the_accepted_formats(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"1234")
    with pytest.raises(ValueError, match="not a safetensors file"):
        checkpoints.open_source(tmp_path / "x.bin")
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match="Orbax checkpoint directory"):
        checkpoints.open_source(tmp_path / "dir")
    with pytest.raises(FileNotFoundError):
        checkpoints.open_source(tmp_path / "missing")
    (tmp_path / "bad.safetensors").write_bytes(b"\x01")
    with pytest.raises(ValueError, match="not a safetensors file"):
        checkpoints.open_source(tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="unknown checkpoint format"):
        checkpoints.create_writer(tmp_path / "o", "pickle")


def test_orbax_reads_one_leaf_without_restoring_the_others(tmp_path, monkeypatch):
    examples.write_example_checkpoint(tmp_path / "c", "orbax")
    import orbax.checkpoint as ocp

    restored_keys = []
    original = ocp.PyTreeCheckpointer.restore

    def spy(self, path, *args, **kwargs):
        result = original(self, path, *args, **kwargs)
        restored_keys.append(result)
        return result

    monkeypatch.setattr(ocp.PyTreeCheckpointer, "restore", spy)
    with checkpoints.open_source(tmp_path / "c") as source:
        source.read("params/Dense_1/kernel")
    (tree,) = restored_keys
    assert tree == {"params": {"Dense_1": {"kernel": tree["params"]["Dense_1"]["kernel"]}}}
