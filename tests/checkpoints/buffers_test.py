"""Reused read buffers: a buffer is handed out again only once nothing refers to it."""

from __future__ import annotations

import numpy as np
import pytest
import safetensors.numpy

from qmill.checkpoints.base import buffers
from qmill.checkpoints.formats.safetensors import source as source_lib


def test_a_buffer_in_use_is_never_handed_out_again():
    pool = buffers.BufferPool(keep_bytes=64 << 20)
    first = pool.take(4 << 20)
    view = first[10:]  # a view keeps the buffer in use after the array itself is gone
    address = first.ctypes.data
    del first
    second = pool.take(4 << 20)
    assert second.ctypes.data != address
    del view
    third = pool.take(4 << 20)
    assert third.ctypes.data == address
    assert third.ctypes.data % buffers.ALIGNMENT == 0


def test_kept_bytes_are_bounded_and_small_buffers_are_not_kept():
    pool = buffers.BufferPool(keep_bytes=8 << 20)
    held = [pool.take(3 << 20) for _ in range(4)]  # all in use: the oldest are dropped
    assert sum(r.size for r in pool._kept) <= 8 << 20
    small = pool.take(1000)
    assert all(r.size > 1000 + buffers.ALIGNMENT for r in pool._kept)
    del held, small


def test_source_reads_stay_correct_while_earlier_tensors_are_held(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {f"t{i}": rng.standard_normal((512, 1024), np.float32) for i in range(6)}
    path = tmp_path / "w.safetensors"
    safetensors.numpy.save_file(tensors, str(path))
    source = source_lib.SafetensorsSource([path])
    try:
        held = {name: source.read(name) for name in ("t0", "t1")}
        for name in tensors:  # each dropped at once: its buffer is reused for the next
            np.testing.assert_array_equal(source.read(name), tensors[name])
        for name, array in held.items():  # untouched by the reads that reused buffers
            np.testing.assert_array_equal(array, tensors[name])
        address = source.read("t2").ctypes.data  # dropped at once: free for the next read
        assert address % buffers.ALIGNMENT == 0
        assert source.read("t3").ctypes.data == address
    finally:
        source.close()


def test_mapped_reads_view_the_file_and_small_or_truncated_tensors_are_read(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {
        "big": rng.standard_normal((512, 1024), np.float32),  # 2 MiB: mapped
        "small": rng.standard_normal((16, 16), np.float32),  # read into a buffer
        "half": rng.standard_normal((1024, 512)).astype(np.float16),  # 1 MiB: mapped
    }
    path = tmp_path / "w.safetensors"
    safetensors.numpy.save_file(tensors, str(path))
    source = source_lib.SafetensorsSource([path])
    source.mapped = True
    try:
        read = {name: source.read(name) for name in tensors}
        for name, array in tensors.items():
            assert read[name].dtype == array.dtype and read[name].shape == array.shape
            np.testing.assert_array_equal(read[name], array)
        assert not read["big"].flags.writeable and not read["half"].flags.writeable
        assert read["small"].flags.writeable
    finally:
        source.close()
    np.testing.assert_array_equal(read["big"], tensors["big"])  # the mapping outlives close()
    # A file cut short after it was opened is never mapped past its end (that would be SIGBUS):
    # the read says it is truncated.
    source = source_lib.SafetensorsSource([path])
    source.mapped = True
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    try:
        last = max(tensors, key=lambda n: source._where[n].begin)
        assert last != "small"  # a tensor the source maps
        with pytest.raises(ValueError, match="truncated"):
            source.read(last)
    finally:
        source.close()
