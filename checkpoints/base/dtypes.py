"""How tensors are stored on disk when a format cannot hold them as they are, exactly.

- 4-bit types (int4, uint4, float4_e2m1fn; nf4 codes are uint4): *packed* in every format, two
  codes per byte, low nibble first (element 0 in bits 0-3 of byte 0), as the wire carries them,
  into a flat uint8 array of ceil(n / 2) bytes. The logical dtype and shape are recorded.
- 1- and 2-bit integers (int2, uint2, ...): the same values as int8 / uint8, one value per byte
  (no format or engine path produces them in bulk; packing them would buy little).
- Every other dtype a format lacks (float8_e4m3 in Orbax, bfloat16 and float8 in npz, ...): its
  raw bits as the unsigned integer of the same width (a *carrier*).

A writer keeps a `Record` of {path: logical dtype name} and {path: logical shape} (packed
tensors only) beside the data, and the reader undoes the storage with it, so every dtype
round-trips bit for bit. Files written before packing (4-bit values one per byte as int8 /
uint8, a dtype record and no shape record) still read back: the by-value carrier is undone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Container
from typing import Any

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


# 4-bit types travel, are stored and are counted two codes per byte, low nibble first.
PACKED_4BIT = frozenset({"int4", "uint4", "float4_e2m1fn"})


def packed_nbytes(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor with 4-bit codes packed two per byte, as the wire and disk hold it."""
    count = math.prod(shape)
    if np.dtype(dtype).name in PACKED_4BIT:
        return (count + 1) // 2
    return count * np.dtype(dtype).itemsize


def pack_4bit(array: np.ndarray) -> np.ndarray:
    """A 4-bit array as a flat uint8 array, two codes per byte, low nibble first; an odd count
    leaves the last high nibble zero."""
    # ml_dtypes keeps each 4-bit code in the low nibble of its byte.
    nibbles = np.ascontiguousarray(array).reshape(-1).view(np.uint8) & 0x0F
    if nibbles.size % 2:
        nibbles = np.concatenate([nibbles, np.zeros(1, np.uint8)])
    return nibbles[0::2] | (nibbles[1::2] << 4)


def unpack_4bit(packed: np.ndarray, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Undoes `pack_4bit`: the array of `dtype` and `shape` whose codes `packed` holds."""
    count = math.prod(shape)
    if packed.dtype != np.uint8 or packed.ndim != 1 or packed.size != (count + 1) // 2:
        raise ValueError(
            f"packed 4-bit data is {packed.dtype}{list(packed.shape)}, not the "
            f"{(count + 1) // 2} uint8 bytes of a {dtype.name}{list(shape)} tensor"
        )
    nibbles = np.empty(packed.size * 2, np.uint8)
    nibbles[0::2] = packed & 0x0F
    nibbles[1::2] = packed >> 4
    return nibbles[:count].view(dtype).reshape(shape)


@dataclasses.dataclass(frozen=True, eq=False)
class Packed4:
    """A 4-bit tensor already packed as `pack_4bit` packs it: `packed` (flat uint8, two codes per
    byte, low nibble first) stands for an array of `dtype` and `shape`.

    The engine packs codes where it makes them (engine/modelfree/packing.py), so writers
    (Record.store), the partial output and the wire take these bytes as they are instead of
    repacking them on the host. `np.asarray(p)` (or `p.unpack()`) gives the array back.
    """

    packed: np.ndarray
    dtype: np.dtype
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", np.dtype(self.dtype))
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.dtype.name not in PACKED_4BIT:
            raise ValueError(
                f"Packed4 holds 4-bit dtypes ({sorted(PACKED_4BIT)}), not {self.dtype}"
            )
        count = math.prod(self.shape)
        if self.packed.dtype != np.uint8 or self.packed.shape != ((count + 1) // 2,):
            raise ValueError(
                f"packed 4-bit data is {self.packed.dtype}{list(self.packed.shape)}, not the "
                f"{(count + 1) // 2} uint8 bytes of a {self.dtype.name}{list(self.shape)} tensor"
            )

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def unpack(self) -> np.ndarray:
        return unpack_4bit(self.packed, self.dtype, self.shape)

    def tobytes(self) -> bytes:
        """The unpacked array's bytes (one code per byte), as numpy's tobytes would give."""
        return self.unpack().tobytes()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self.unpack()
        return array if dtype is None else array.astype(dtype)


def packed_or_array(array: Any) -> Packed4 | np.ndarray:
    """A Packed4 as it is, anything else as a numpy array."""
    return array if isinstance(array, Packed4) else np.asarray(array)


class Record:
    """What a reader needs to give back the logical arrays of a checkpoint: {path: logical dtype
    name} for tensors not stored as themselves, {path: logical shape} for packed ones. Writers
    fill it with `store`; readers build it from the file's metadata and call `restore`."""

    def __init__(
        self, dtypes: dict[str, str] | None = None, packed: dict[str, Any] | None = None
    ) -> None:
        self.dtypes: dict[str, str] = dict(dtypes or {})
        self.packed: dict[str, list[int]] = {k: list(v) for k, v in (packed or {}).items()}
        for key, shape in self.packed.items():
            if self.dtypes.get(key) not in PACKED_4BIT:
                raise ValueError(f"tensor {key} is recorded as packed but not as a 4-bit dtype")
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"tensor {key} has a packed shape {shape} that is not a shape")

    def store(self, key: str, array: np.ndarray | Packed4, native: Container[str]) -> np.ndarray:
        """`array` as the format stores it (packed, carried or itself), recorded under `key`."""
        name = array.dtype.name
        if name in PACKED_4BIT:
            self.dtypes[key] = name
            self.packed[key] = [int(d) for d in array.shape]
            return array.packed if isinstance(array, Packed4) else pack_4bit(array)
        stored, logical = to_carrier(array, native)
        if logical:
            self.dtypes[key] = logical
        return stored

    def logical(
        self, key: str, stored: np.dtype, shape: tuple[int, ...]
    ) -> tuple[np.dtype, tuple[int, ...]]:
        """(dtype, shape) of tensor `key` as the reader gives it back, from metadata alone."""
        if key in self.packed:
            return logical_dtype(self.dtypes[key]), tuple(self.packed[key])
        return carried_dtype(stored, self.dtypes.get(key)), tuple(shape)

    def restore(self, key: str, stored: np.ndarray) -> np.ndarray:
        """Undoes `store` for tensor `key`."""
        if key in self.packed:
            try:
                dtype = logical_dtype(self.dtypes[key])
                return unpack_4bit(stored, dtype, tuple(self.packed[key]))
            except ValueError as e:
                raise ValueError(f"tensor {key}: {e}") from None
        return from_carrier(stored, self.dtypes.get(key))
