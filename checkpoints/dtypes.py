"""Dtypes a checkpoint format cannot hold, stored in one it can (a *carrier*), exactly.

- Sub-byte integers (int4, uint4, int2, uint2): the same values as int8 / uint8, one value per
  byte. Any reader then sees the right numbers; ours turns them back into int4 / uint4.
- Every other dtype a format lacks (float8_e4m3 in Orbax, bfloat16 and float8 in npz, float4
  in safetensors, ...): its raw bits as the unsigned integer of the same width.

The writer records {path: logical dtype name} beside the data and the reader applies
`from_carrier`, so every dtype round-trips bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Container

import ml_dtypes
import numpy as np

# Value carriers: astype is exact both ways for every value these types can hold.
# numpy's own dtypes (kinds b, i, u, f, c), which every format here can hold or npy can name.
NUMPY_NATIVE = frozenset(
    np.dtype(t).name
    for t in (
        np.bool_,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
    )
)

_BY_VALUE = {
    "int4": np.dtype(np.int8),
    "uint4": np.dtype(np.uint8),
    "int2": np.dtype(np.int8),
    "uint2": np.dtype(np.uint8),
    "int1": np.dtype(np.int8),
    "uint1": np.dtype(np.uint8),
}
_BITS = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}


def logical_dtype(name: str) -> np.dtype:
    """The dtype called `name`, ml_dtypes' included ("bfloat16", "float8_e4m3fn", "int4")."""
    if hasattr(ml_dtypes, name):
        return np.dtype(getattr(ml_dtypes, name))
    try:
        return np.dtype(name)
    except TypeError:
        raise ValueError(f"unknown dtype {name!r} in checkpoint metadata") from None


def to_carrier(array: np.ndarray, native: Container[str]) -> tuple[np.ndarray, str | None]:
    """Returns (array in a dtype whose name is in `native`, the logical dtype name or None when
    the array was native already)."""
    name = array.dtype.name
    if name in native:
        return array, None
    if name in _BY_VALUE:
        return array.astype(_BY_VALUE[name]), name
    if array.dtype.kind in "OUSMm" or array.dtype.itemsize not in _BITS:
        raise ValueError(f"tensors of dtype {name} cannot be stored in a checkpoint")
    return array.view(_BITS[array.dtype.itemsize]), name


def from_carrier(array: np.ndarray, logical: str | None) -> np.ndarray:
    """Undoes `to_carrier`."""
    if logical is None:
        return array
    dtype = logical_dtype(logical)
    return array.astype(dtype) if logical in _BY_VALUE else array.view(dtype)


def carried_dtype(stored: np.dtype, logical: str | None) -> np.dtype:
    """The logical dtype of a stored dtype, from metadata alone (for listing entries)."""
    return np.dtype(stored) if logical is None else logical_dtype(logical)


# 4-bit types travel (and are counted) two codes per byte, low nibble first.
PACKED_4BIT = frozenset({"int4", "uint4", "float4_e2m1fn"})


def packed_nbytes(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor with 4-bit codes packed two per byte, as the wire carries it."""
    count = math.prod(shape)
    if np.dtype(dtype).name in PACKED_4BIT:
        return (count + 1) // 2
    return count * np.dtype(dtype).itemsize
