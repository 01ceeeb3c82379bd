"""4-bit tensors on disk: two codes per byte in every format, exact back, old files still read."""

from __future__ import annotations

import json
import pathlib

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy

from qmill import checkpoints
from qmill.checkpoints.base import dtypes, staging

FOUR_BIT = [ml_dtypes.int4, ml_dtypes.uint4, ml_dtypes.float4_e2m1fn]


def _every_code(dtype, count: int) -> np.ndarray:
    """`count` values of a 4-bit dtype cycling through all 16 bit patterns."""
    return (np.arange(count, dtype=np.uint8) % 16).view(dtype)


def _size(path: pathlib.Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.parametrize("dtype", FOUR_BIT)
@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (4, 4), (2, 0)])
def test_pack_then_unpack_gives_every_code_back(dtype, shape):
    array = _every_code(dtype, int(np.prod(shape))).reshape(shape)
    packed = dtypes.pack_4bit(array)
    assert packed.dtype == np.uint8 and packed.shape == ((array.size + 1) // 2,)
    back = dtypes.unpack_4bit(packed, np.dtype(dtype), shape)
    assert back.dtype == dtype and back.shape == shape
    assert back.tobytes() == array.tobytes()


def test_low_nibble_holds_the_first_code():
    packed = dtypes.pack_4bit(np.array([1, -2, 3], ml_dtypes.int4))
    assert packed.tolist() == [0x01 | 0x0E << 4, 0x03]


def test_unpack_refuses_a_byte_count_that_does_not_fit_the_shape():
    with pytest.raises(ValueError, match="not the 3 uint8 bytes"):
        dtypes.unpack_4bit(np.zeros(2, np.uint8), np.dtype(ml_dtypes.int4), (5,))


@pytest.mark.parametrize("dtype", FOUR_BIT)
def test_odd_4bit_tensors_round_trip_in_every_format(dest, fmt, dtype):
    array = _every_code(dtype, 3 * 7).reshape(3, 7)
    with checkpoints.create_writer(dest, fmt) as w:
        w.write_quantized("l/w", {"qvalue": array, "scale": np.ones((1, 7), np.float32)})
        w.write("scalar", np.array(5, np.uint8).view(dtype))  # bit pattern 0101
    with checkpoints.open_source(dest) as source:
        entries = {e.path: e for e in source.entries()}
        assert (entries["l/w/array/qvalue"].dtype, entries["l/w/array/qvalue"].shape) == (
            np.dtype(dtype),
            (3, 7),
        )
        assert source.read("l/w/array/qvalue").tobytes() == array.tobytes()
        scalar = source.read("scalar")
        assert scalar.shape == () and scalar.dtype == dtype and int(scalar.view(np.uint8)) == 5


def test_a_4bit_file_is_about_half_the_8bit_file(tmp_path, fmt, sample):
    suffix = {"orbax": "", "safetensors": ".safetensors", "npz": ".npz"}[fmt]
    sizes = {}
    for name, dtype in (("int8", np.int8), ("int4", ml_dtypes.int4)):
        out = tmp_path / f"{name}{suffix}"
        with checkpoints.create_writer(out, fmt) as w:
            for i in range(4):
                qvalue = sample(np.int8, (256, 256), i).clip(-8, 7).astype(dtype)
                w.write_quantized(f"l{i}/kernel", {"qvalue": qvalue, "scale": np.ones((1, 256))})
        sizes[name] = _size(out)
    # Scales (8 KiB of 264 KiB) and headers keep it a little above one half.
    assert sizes["int4"] <= 0.55 * sizes["int8"], sizes


def test_files_written_before_packing_still_read_back(dest, fmt, sample, monkeypatch):
    """qmill wrote 4-bit values one per byte (int8 / uint8 plus a dtype record; int4 native in
    Orbax) until packing; such files give the same arrays back."""
    int4 = sample(ml_dtypes.int4, (3, 5))
    uint4 = sample(ml_dtypes.uint4, (5,))
    with monkeypatch.context() as m:
        m.setattr(dtypes, "PACKED_4BIT", frozenset())  # the writers as they were
        with checkpoints.create_writer(dest, fmt) as w:
            w.write("a/int4", int4)
            w.write("a/uint4", uint4)
    if fmt == "safetensors":
        with safetensors.safe_open(dest, "np") as f:
            assert f.get_tensor("a/int4").dtype == np.int8 and "qmill.packed" not in f.metadata()
    with checkpoints.open_source(dest) as source:
        assert {e.path: e.shape for e in source.entries()} == {"a/int4": (3, 5), "a/uint4": (5,)}
        assert source.read("a/int4").tobytes() == int4.tobytes()
        back = source.read("a/uint4")
        assert back.dtype == ml_dtypes.uint4 and back.tobytes() == uint4.tobytes()


def test_a_packed_record_that_does_not_fit_the_data_is_named(tmp_path):
    path = tmp_path / "bad.safetensors"
    metadata = {"qmill.dtypes": json.dumps({"w": "int4"}), "qmill.packed": json.dumps({"w": [9]})}
    safetensors.numpy.save_file({"w": np.zeros(2, np.uint8)}, path, metadata=metadata)
    with checkpoints.open_source(path) as source:
        assert source.entries()[0].shape == (9,)
        with pytest.raises(ValueError, match=r"bad\.safetensors: tensor w: packed 4-bit data"):
            source.read("w")


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"qmill.packed": json.dumps({"w": [4]})}, "packed but not as a 4-bit dtype"),
        (
            {"qmill.dtypes": json.dumps({"w": "int4"}), "qmill.packed": json.dumps({"w": [-1]})},
            "not a shape",
        ),
        ({"qmill.packed": "{"}, "malformed qmill dtype record"),
    ],
)
def test_a_malformed_packed_record_is_refused_on_open(tmp_path, record, message):
    path = tmp_path / "bad.safetensors"
    safetensors.numpy.save_file({"w": np.zeros(2, np.uint8)}, path, metadata=record)
    with pytest.raises(ValueError, match=message):
        checkpoints.open_source(path)


@pytest.mark.parametrize("dtype", FOUR_BIT)
def test_packed4_is_stored_as_it_is_and_unpacks(dtype):
    array = _every_code(dtype, 15).reshape(3, 5)
    packed = dtypes.Packed4(dtypes.pack_4bit(array), np.dtype(dtype), (3, 5))
    assert packed.size == 15 and packed.ndim == 2
    assert np.asarray(packed).tobytes() == array.tobytes()
    record = dtypes.Record()
    assert record.store("w", packed, dtypes.NUMPY_NATIVE) is packed.packed
    assert record.packed == {"w": [3, 5]} and record.dtypes == {"w": np.dtype(dtype).name}


def test_packed4_refuses_bytes_that_do_not_fit():
    with pytest.raises(ValueError, match="not the 8 uint8 bytes of a int4"):
        dtypes.Packed4(np.zeros(7, np.uint8), np.dtype(ml_dtypes.int4), (3, 5))
    with pytest.raises(ValueError, match="4-bit dtypes"):
        dtypes.Packed4(np.zeros(8, np.uint8), np.dtype(np.int8), (3, 5))


@pytest.mark.parametrize("fmt", ["safetensors", "npz"])
def test_a_packed4_part_writes_the_same_file_as_its_array(tmp_path, fmt):
    array = _every_code(ml_dtypes.int4, 21).reshape(3, 7)
    scale = np.ones((3, 1), np.float32)
    packed = dtypes.Packed4(dtypes.pack_4bit(array), array.dtype, array.shape)
    files = []
    for name, qvalue in (("a", array), ("b", packed)):
        out = tmp_path / f"{name}.{fmt}"
        with checkpoints.create_writer(out, fmt) as writer:
            writer.write_quantized("w", {"qvalue": qvalue, "scale": scale})
        files.append(out.read_bytes())
    assert files[0] == files[1]


def test_the_partial_output_keeps_packed_parts_packed(tmp_path):
    array = _every_code(ml_dtypes.uint4, 9).reshape(9)
    packed = dtypes.Packed4(dtypes.pack_4bit(array), array.dtype, array.shape)
    partial = staging.PartialOutput(tmp_path / "out", {"k": 1}, restart=False)
    partial.record(0, "w", {"qvalue": packed, "scale": np.ones(1, np.float32)}, {})
    partial.close()
    again = staging.PartialOutput(tmp_path / "out", {"k": 1}, restart=False)
    back = again.load("w")["qvalue"]
    assert isinstance(back, dtypes.Packed4) and back.shape == (9,) and back.dtype == array.dtype
    assert back.packed.tobytes() == packed.packed.tobytes()
    again.close()
