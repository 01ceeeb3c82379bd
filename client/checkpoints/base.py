"""What every checkpoint format shares: entries, the reader/writer protocols, dtypes a format
cannot store, and atomic placement of the finished output.

Storing dtypes a format lacks: a format that cannot hold a dtype gets a *carrier* instead and the
logical dtype is recorded beside the data (safetensors `__metadata__`, an Orbax side file, an npz
member). 4-bit integers travel as 8-bit integers of the same value (other readers still see the
right numbers); other 1-byte floats travel as their raw bits in uint8. Our readers restore the
logical dtype, so every dtype round-trips bit for bit.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import uuid
from typing import Protocol

import ml_dtypes
import numpy as np

DTYPES_KEY = "qmill.dtypes"
_VALUE_CARRIERS = {
    "int4": np.dtype(np.int8),
    "uint4": np.dtype(np.uint8),
    "int2": np.dtype(np.int8),
}


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """A tensor of a checkpoint, described without reading its data."""

    path: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class TensorSource(Protocol):
    format: str
    separator: str

    def entries(self) -> list[TensorEntry]: ...
    def read(self, path: str) -> np.ndarray: ...
    def close(self) -> None: ...
    def __enter__(self) -> TensorSource: ...
    def __exit__(self, *exc: object) -> None: ...


class CheckpointWriter(Protocol):
    def write(self, path: str, array: np.ndarray) -> None: ...
    def write_quantized(self, path: str, parts: dict[str, np.ndarray]) -> None: ...
    def commit(self) -> None: ...
    def abort(self) -> None: ...


def to_carrier(array: np.ndarray, supported: frozenset[str]) -> tuple[np.ndarray, str | None]:
    """(array the format can store, logical dtype name or None when no carrier was needed)."""
    name = array.dtype.name
    if name in supported:
        return array, None
    if name in _VALUE_CARRIERS:
        return array.astype(_VALUE_CARRIERS[name]), name
    if array.dtype.itemsize == 1:
        return array.view(np.uint8), name
    raise ValueError(f"dtype {name} cannot be stored in this checkpoint format")


def from_carrier(array: np.ndarray, logical: str | None) -> np.ndarray:
    if logical is None:
        return array
    dtype = np.dtype(getattr(ml_dtypes, logical, logical))
    return array.astype(dtype) if logical in _VALUE_CARRIERS else array.view(dtype)


def quantized_paths(
    path: str, parts: dict[str, np.ndarray], separator: str
) -> dict[str, np.ndarray]:
    """Leaf P's parts at P/array/qvalue, P/array/scale (+ zero_point): the Qwix PTQ layout."""
    unknown = set(parts) - {"qvalue", "scale", "zero_point"}
    if unknown or not {"qvalue", "scale"} <= set(parts):
        raise ValueError(
            f"{path}: quantized parts must be qvalue, scale[, zero_point], got {sorted(parts)}"
        )
    return {separator.join((path, "array", name)): value for name, value in parts.items()}


class AtomicOutput:
    """A staging path beside `destination` that becomes `destination` only on commit."""

    def __init__(self, destination: str | os.PathLike, *, overwrite: bool) -> None:
        # Absolute: Orbax refuses relative paths, and a later chdir must not move the output.
        self.destination = pathlib.Path(destination).absolute()
        if self.destination.exists() and not overwrite:
            raise FileExistsError(f"{self.destination} exists; pass --overwrite to replace it")
        self.destination.parent.mkdir(parents=True, exist_ok=True)
        tag = uuid.uuid4().hex[:8]
        self.staging = self.destination.with_name(f".{self.destination.name}.qmill-tmp-{tag}")

    def commit(self) -> None:
        """Moves the staged output into place; an old destination is removed only after."""
        old = None
        if self.destination.exists():
            old = self.destination.with_name(
                f".{self.destination.name}.qmill-old-{uuid.uuid4().hex[:8]}"
            )
            os.rename(self.destination, old)
        os.rename(self.staging, self.destination)
        if old is not None:
            _remove(old)

    def abort(self) -> None:
        # Also what a library staged beside ours (Orbax writes "<name>.orbax-checkpoint-tmp").
        for path in self.staging.parent.glob(self.staging.name + "*"):
            _remove(path)


def _remove(path: pathlib.Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


class WriterBase:
    """Context-manager behaviour shared by the writers: commit on success, abort on error."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
            return
        try:
            self.commit()
        except BaseException:
            self.abort()
            raise
