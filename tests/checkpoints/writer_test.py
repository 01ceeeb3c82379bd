"""Atomic outputs in every format: staged beside the destination, renamed on commit, deleted on
failure; existing destinations refused unless overwrite; misuse named."""

from __future__ import annotations

import numpy as np
import pytest

from qmill import checkpoints


def _write_some(writer, value=1.0):
    writer.write("params/a", np.full(3, value, np.float32))
    writer.write_quantized(
        "params/k", {"qvalue": np.ones((2, 2), np.int8), "scale": np.ones((1, 2), np.float32)}
    )


def test_output_appears_only_on_commit(tmp_path, dest, fmt):
    with checkpoints.create_writer(dest, fmt) as writer:
        _write_some(writer)
        assert not dest.exists()
        (staged,) = tmp_path.iterdir()
        assert staged.name.startswith(f".{dest.name}.qmill-tmp-")
    assert [p.name for p in tmp_path.iterdir()] == [dest.name]


def test_an_exception_leaves_no_destination_and_no_staging(tmp_path, dest, fmt):
    with (
        pytest.raises(RuntimeError, match="interrupted"),
        checkpoints.create_writer(dest, fmt) as writer,
    ):
        _write_some(writer)
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_a_sharded_output_is_atomic_too(tmp_path):
    with (
        pytest.raises(RuntimeError),
        checkpoints.create_writer(tmp_path / "out", "safetensors", max_shard_bytes=8) as writer,
    ):
        _write_some(writer)
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_existing_destination_is_refused_unless_overwrite(tmp_path, dest, fmt):
    with checkpoints.create_writer(dest, fmt) as writer:
        _write_some(writer, 1.0)
    with pytest.raises(FileExistsError, match="--overwrite"):
        checkpoints.create_writer(dest, fmt)
    with checkpoints.create_writer(dest, fmt, overwrite=True) as writer:
        _write_some(writer, 2.0)
        with checkpoints.open_source(dest) as old:  # still the old one while writing
            assert old.read("params/a").tolist() == [1.0, 1.0, 1.0]
    with checkpoints.open_source(dest) as new:
        assert new.read("params/a").tolist() == [2.0, 2.0, 2.0]
    assert [p.name for p in tmp_path.iterdir()] == [dest.name]


def test_a_failed_overwrite_keeps_the_old_checkpoint(tmp_path, dest, fmt):
    with checkpoints.create_writer(dest, fmt) as writer:
        _write_some(writer, 1.0)
    with (
        pytest.raises(RuntimeError),
        checkpoints.create_writer(dest, fmt, overwrite=True) as writer,
    ):
        _write_some(writer, 2.0)
        raise RuntimeError("interrupted")
    with checkpoints.open_source(dest) as old:
        assert old.read("params/a").tolist() == [1.0, 1.0, 1.0]


def test_misuse_is_named(tmp_path, dest, fmt):
    writer = checkpoints.create_writer(dest, fmt)
    writer.write("params/a", np.ones(2, np.float32))
    with pytest.raises(ValueError, match="written twice"):
        writer.write("params/a", np.ones(2, np.float32))
    with pytest.raises(ValueError, match="qvalue, scale"):
        writer.write_quantized("params/k", {"qvalue": np.ones(2, np.int8)})
    with pytest.raises(ValueError, match="qvalue, scale"):
        writer.write_quantized(
            "params/k", {"qvalue": np.ones(2), "scale": np.ones(1), "bias": np.ones(1)}
        )
    writer.commit()
    with pytest.raises(RuntimeError, match="already committed"):
        writer.write("params/b", np.ones(2, np.float32))
    writer.abort()  # a no-op once committed
    assert dest.exists()


def test_destination_parents_are_created(tmp_path, fmt):
    dest = (
        tmp_path / "a" / "b" / {"orbax": "c", "safetensors": "c.safetensors", "npz": "c.npz"}[fmt]
    )
    with checkpoints.create_writer(dest, fmt) as writer:
        _write_some(writer)
    with checkpoints.open_source(dest) as source:
        assert len(source.entries()) == 3


def test_callers_may_reuse_their_buffers(tmp_path, dest, fmt):
    buffer = np.zeros(4, np.float32)
    with checkpoints.create_writer(dest, fmt) as writer:
        for i in range(3):
            buffer[:] = i
            writer.write(f"t/{i}", buffer)
    with checkpoints.open_source(dest) as source:
        assert [source.read(f"t/{i}")[0] for i in range(3)] == [0, 1, 2]


@pytest.mark.parametrize("name", ["awq_scale", "inv_sq_scale"])
def test_a_per_channel_scale_lies_beside_the_qarray(tmp_path, dest, fmt, name):
    # AWQ / SmoothQuant params: P/awq_scale (or P/inv_sq_scale) beside P/array/{qvalue,scale},
    # as the reference's WithAwqScale / WithSqScale nest, in every format.
    parts = {
        "qvalue": np.arange(-4, 4, dtype=np.int8).reshape(2, 4),
        "scale": np.full((1, 4), 0.5, np.float32),
        name: np.array([1.0, 0.25], np.float32),
    }
    with checkpoints.create_writer(dest, fmt) as writer:
        writer.write_quantized("params/k", parts)
    kernel = checkpoints.load(dest)["params"]["k"]
    assert set(kernel) == {"array", name} and set(kernel["array"]) == {"qvalue", "scale"}
    for part in ("qvalue", "scale"):
        np.testing.assert_array_equal(kernel["array"][part], parts[part])
    np.testing.assert_array_equal(kernel[name], parts[name])
    assert kernel[name].dtype == np.float32


def test_two_per_channel_scales_are_refused(tmp_path, dest, fmt):
    writer = checkpoints.create_writer(dest, fmt)
    both = {"awq_scale": np.ones(2, np.float32), "inv_sq_scale": np.ones(2, np.float32)}
    with pytest.raises(ValueError, match="at most one of awq_scale, inv_sq_scale"):
        writer.write_quantized(
            "params/k", {"qvalue": np.ones(2, np.int8), "scale": np.ones(1), **both}
        )
    writer.abort()
