"""Every dtype, scalars and empty arrays round-trip bit for bit through every format."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from qmill import checkpoints
from qmill.checkpoints.base import dtypes

# numpy's own dtypes; complex128 excepted, which safetensors has no dtype (nor carrier) for.
NUMPY_DTYPES = sorted(dtypes.NUMPY_NATIVE - {"complex128"})
# Every ml_dtypes type numpy can hold one per element (the complex32 pair excepted).
ML_DTYPES = [
    getattr(ml_dtypes, name)
    for name in (
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3",
        "float8_e3m4",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e4m3b11fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn",
        "float6_e2m3fn",
        "float6_e3m2fn",
        "int4",
        "uint4",
        "int2",
        "uint2",
    )
    if hasattr(ml_dtypes, name)
]


def _tree(sample) -> dict[str, np.ndarray]:
    tree = {f"t/{np.dtype(d).name}": sample(d, (3, 5)) for d in NUMPY_DTYPES + ML_DTYPES}
    tree["scalar/int32"] = np.array(7, np.int32)
    tree["scalar/bfloat16"] = np.array(1.5, ml_dtypes.bfloat16)
    tree["scalar/uint4"] = np.array(9, ml_dtypes.uint4)
    tree["empty/float32"] = np.zeros((0, 4), np.float32)
    tree["fortran/float32"] = np.asfortranarray(sample(np.float32, (4, 3)))
    return tree


def test_every_dtype_round_trips_in_every_format(dest, fmt, sample):
    tree = _tree(sample)
    with checkpoints.create_writer(dest, fmt) as writer:
        for path, array in tree.items():
            writer.write(path, array)
    with checkpoints.open_source(dest) as source:
        entries = {e.path: e for e in source.entries()}
        assert set(entries) == set(tree)
        for path, array in tree.items():
            entry = entries[path]
            assert (entry.dtype, entry.shape, entry.nbytes) == (
                array.dtype,
                array.shape,
                array.nbytes,
            ), path
            back = source.read(path)
            assert back.dtype == array.dtype and back.shape == array.shape, path
            assert back.tobytes() == np.ascontiguousarray(array).tobytes(), path


@pytest.mark.parametrize("name", ["int4", "uint4", "int2", "uint2"])
def test_sub_byte_integers_are_carried_by_value(name, sample):
    array = sample(getattr(ml_dtypes, name), (16,))
    stored, logical = dtypes.to_carrier(array, frozenset())
    assert logical == name and stored.dtype.itemsize == 1
    # Other readers see the numbers themselves, not ml_dtypes' byte encoding.
    assert stored.astype(np.int64).tolist() == array.astype(np.int64).tolist()


@given(st.binary(min_size=2, max_size=64).filter(lambda b: len(b) % 2 == 0))
def test_bit_carriers_keep_every_bit_pattern_nans_included(raw):
    array = np.frombuffer(raw, ml_dtypes.bfloat16)
    stored, logical = dtypes.to_carrier(array, frozenset())
    assert stored.dtype == np.uint16
    assert dtypes.from_carrier(stored, logical).tobytes() == raw


def test_natively_stored_types_need_no_carrier():
    array = np.ones(2, np.float32)
    stored, logical = dtypes.to_carrier(array, frozenset({"float32"}))
    assert stored is array and logical is None


def test_unstorable_dtypes_and_unknown_names_are_refused():
    with pytest.raises(ValueError, match="cannot be stored"):
        dtypes.to_carrier(np.array(["a"]), frozenset())
    with pytest.raises(ValueError, match="unknown dtype"):
        dtypes.logical_dtype("float7")
