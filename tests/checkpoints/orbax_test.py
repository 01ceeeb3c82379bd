"""Orbax: Qwix layout through plain restore, one-leaf reads, incremental group saves, inputs
saved by Orbax itself."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from qmill import checkpoints
from qmill.checkpoints.base import dtypes
from qmill.checkpoints.formats.orbax import writer as orbax_writer


def _bytes_read() -> int:
    # rchar counts every byte read(2)/pread(2) returned, page cache hits included.
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def test_quantized_leaf_loads_as_qwix_layout_with_plain_orbax(tmp_path, sample):
    qvalue = sample(ml_dtypes.int4, (4, 6))
    scale = np.ones((1, 6), np.float32)
    zero_point = sample(np.int8, (1, 6))
    with checkpoints.create_writer(tmp_path / "q", "orbax") as writer:
        writer.write_quantized(
            "params/Dense_0/kernel", {"qvalue": qvalue, "scale": scale, "zero_point": zero_point}
        )
        writer.write("params/Dense_0/bias", np.zeros(6, np.float32))
        writer.write("step", np.array(3, np.int32))
    restored = ocp.PyTreeCheckpointer().restore(tmp_path / "q")
    assert set(restored) == {"params", "step"}
    kernel = restored["params"]["Dense_0"]["kernel"]
    assert set(kernel) == {"array"} and set(kernel["array"]) == {"qvalue", "scale", "zero_point"}
    # Packed two codes per byte (tensorstore would spend a byte on each int4).
    assert kernel["array"]["qvalue"].dtype == np.uint8
    assert kernel["array"]["qvalue"].tobytes() == dtypes.pack_4bit(qvalue).tobytes()
    assert kernel["array"]["qvalue"].size == 12
    assert kernel["array"]["zero_point"].tobytes() == zero_point.tobytes()
    with checkpoints.open_source(tmp_path / "q") as source:
        assert source.read("params/Dense_0/kernel/array/qvalue").tobytes() == qvalue.tobytes()
        assert [e.path for e in source.entries()] == [
            "params/Dense_0/bias",
            "params/Dense_0/kernel/array/qvalue",
            "params/Dense_0/kernel/array/scale",
            "params/Dense_0/kernel/array/zero_point",
            "step",
        ]


def test_uint4_loads_packed_with_plain_orbax_and_as_uint4_with_ours(tmp_path, sample):
    indices = sample(ml_dtypes.uint4, (3, 3))  # an odd count: the last byte's high nibble is 0
    with checkpoints.create_writer(tmp_path / "nf4", "orbax") as writer:
        writer.write_quantized("w", {"qvalue": indices, "scale": np.ones(1, np.float32)})
    plain = ocp.PyTreeCheckpointer().restore(tmp_path / "nf4")["w"]["array"]["qvalue"]
    codes = np.append(indices.astype(np.uint8).reshape(-1), 0)
    assert plain.dtype == np.uint8
    assert plain.tolist() == (codes[0::2] | codes[1::2] << 4).tolist()
    metadata = ocp.PyTreeCheckpointer().metadata(tmp_path / "nf4")
    assert metadata.custom_metadata["qmill"]["dtypes"] == {"w/array/qvalue": "uint4"}
    assert metadata.custom_metadata["qmill"]["packed"] == {"w/array/qvalue": [3, 3]}
    with checkpoints.open_source(tmp_path / "nf4") as source:
        assert source.entries()[0].shape == (3, 3)
        back = source.read("w/array/qvalue")
        assert back.dtype == ml_dtypes.uint4 and back.tobytes() == indices.tobytes()


def test_a_read_touches_one_leaf_not_the_others(tmp_path):
    big = np.arange(8 * 2**20, dtype=np.float32)  # 32 MiB
    with checkpoints.create_writer(tmp_path / "c", "orbax") as writer:
        writer.write("params/big", big)
        writer.write("params/small", np.ones(4, np.float32))
    with checkpoints.open_source(tmp_path / "c") as source:
        before = _bytes_read()
        assert source.read("params/small").tolist() == [1, 1, 1, 1]
        small_cost = _bytes_read() - before
        before = _bytes_read()
        assert source.read("params/big").tobytes() == big.tobytes()
        big_cost = _bytes_read() - before
    assert big_cost >= big.nbytes  # the measure sees data reads...
    assert small_cost < 2**20  # ...and reading the small leaf read none of the big one


def test_incremental_group_saves_make_one_plain_checkpoint(tmp_path, sample, monkeypatch):
    tree = {f"layers/{i}/{n}": sample(np.float32, (16, 8), i) for i in range(6) for n in "ab"}
    tree["step"] = np.array(9, np.int64)
    monkeypatch.setattr(orbax_writer, "GROUP_BYTES", 1)  # every leaf is its own save
    with checkpoints.create_writer(tmp_path / "many", "orbax") as writer:
        for path, array in tree.items():
            writer.write(path, array)
    restored = ocp.PyTreeCheckpointer().restore(tmp_path / "many")
    for path, array in tree.items():
        node = restored
        for key in path.split("/"):
            node = node[key]
        assert np.asarray(node).tobytes() == array.tobytes(), path
    # One root OCDBT manifest over the per-save data: what any Orbax save leaves behind.
    assert (tmp_path / "many" / "manifest.ocdbt").is_file()


def test_reads_checkpoints_orbax_saved(tmp_path, sample):
    import jax.numpy as jnp

    tree = {
        "params": {"w": sample(ml_dtypes.bfloat16, (3, 2)), "b": sample(np.float32, (2,))},
        "jax": {"k": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)},
        "opt": [{"mu": sample(np.float32, (2,))}, {"nu": sample(np.float32, (3,))}],
        "step": 7,
        "name": "run-1",  # not a tensor: skipped
    }
    ocp.PyTreeCheckpointer().save(tmp_path / "pytree", tree)
    with ocp.StandardCheckpointer() as standard:  # saves asynchronously; exit waits
        standard.save(tmp_path / "standard", {"params": tree["params"]})
    with checkpoints.open_source(tmp_path / "pytree") as source:
        paths = [e.path for e in source.entries()]
        assert paths == ["jax/k", "opt/0/mu", "opt/1/nu", "params/b", "params/w", "step"]
        jax_leaf = source.read("jax/k")
        assert type(jax_leaf) is np.ndarray and jax_leaf.tobytes() == tree["jax"]["k"].tobytes()
        assert source.read("opt/1/nu").tobytes() == tree["opt"][1]["nu"].tobytes()
        assert source.read("params/w").dtype == ml_dtypes.bfloat16
        assert int(source.read("step")) == 7
    with checkpoints.open_source(tmp_path / "standard") as source:
        assert source.read("params/b").tobytes() == tree["params"]["b"].tobytes()


def test_a_checkpoint_directory_with_one_item_is_read_through(tmp_path, sample):
    step = tmp_path / "run" / "100"
    with ocp.CheckpointManager(tmp_path / "run") as manager:
        manager.save(100, args=ocp.args.StandardSave({"w": sample(np.float32, (2,))}))
    assert step.is_dir()
    with checkpoints.open_source(step) as source:
        assert [e.path for e in source.entries()] == ["w"]


def test_tree_conflicts_and_empty_writers_are_refused(tmp_path):
    with checkpoints.create_writer(tmp_path / "c", "orbax") as writer:
        writer.write("a/b", np.ones(1))
        with pytest.raises(ValueError, match="share a node"):
            writer.write("a/b/c", np.ones(1))
        with pytest.raises(ValueError, match="share a node"):
            writer.write("a", np.ones(1))
        with pytest.raises(ValueError, match="empty key"):
            writer.write("a//d", np.ones(1))
    with (
        pytest.raises(ValueError, match="nothing to write"),
        checkpoints.create_writer(tmp_path / "empty", "orbax"),
    ):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
