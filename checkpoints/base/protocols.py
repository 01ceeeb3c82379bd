"""What a checkpoint source lists and what readers and writers promise, whatever the format."""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint, described without reading its data."""

    # '/'-joined tree keys for Orbax and npz ("params/Dense_0/kernel"); the key verbatim for
    # safetensors ("model.layers.0.mlp.up_proj.weight").
    path: str
    # The logical dtype (ml_dtypes for bfloat16, float8_*, int4), not the one a format stores.
    dtype: np.dtype
    shape: tuple[int, ...]
    # Bytes of the logical array in memory: one byte per element for 4-bit types (ml_dtypes);
    # on disk and on the wire they take half that (dtypes.packed_nbytes).
    nbytes: int


def entry(path: str, dtype: np.dtype, shape: tuple[int, ...] | list[int]) -> TensorEntry:
    """A TensorEntry with its byte size computed from dtype and shape."""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in shape)
    return TensorEntry(path, dtype, shape, math.prod(shape) * dtype.itemsize)


class TensorSource(Protocol):
    """A checkpoint opened for reading one tensor at a time; a context manager."""

    format: str  # "orbax" | "safetensors" | "npz"
    # How the source's own paths nest: "/" for orbax and npz, "." for safetensors names. (The
    # parts a writer adds to a quantized leaf are '/'-joined in every format: P/array/qvalue.)
    separator: str

    def entries(self) -> list[TensorEntry]:
        """All tensors, in a stable order (file order, or sorted tree order for Orbax)."""
        ...

    def read(self, path: str) -> np.ndarray:
        """One tensor, in its logical dtype; nothing else is read."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> TensorSource: ...

    def __exit__(self, *exc: object) -> None: ...


class CheckpointWriter(Protocol):
    """A checkpoint being written; a context manager that commits on a clean exit and aborts on
    an exception, so the destination holds a complete checkpoint or nothing new."""

    def write(self, path: str, array: np.ndarray) -> None:
        """An unquantized leaf, copied as is."""
        ...

    def write_quantized(self, path: str, parts: dict[str, np.ndarray]) -> None:
        """Leaf `path` quantized: parts "qvalue", "scale" and optionally "zero_point" land at
        path/array/qvalue etc. (the Qwix PTQ param layout), '/' in every format; an AWQ /
        SmoothQuant per-channel part ("awq_scale" / "inv_sq_scale") at path/awq_scale etc."""
        ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...

    def __enter__(self) -> CheckpointWriter: ...

    def __exit__(self, *exc: object) -> None: ...
