"""NumPy .npz archives, member by member (a zip of .npy files; keys are '/'-joined paths).

npy cannot describe bfloat16, float8 or int4, so such arrays are stored as carriers (see base)
and their logical dtypes in a JSON member named `__qmill_dtypes__`.
"""

from __future__ import annotations

import json
import os
import pathlib
import zipfile
from typing import Any

import numpy as np

from qmill.client.checkpoints import base

DTYPES_MEMBER = "__qmill_dtypes__"
_NATIVE = frozenset(
    {
        "float16",
        "float32",
        "float64",
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
    }
)
_BFLOAT16_CARRIER = np.dtype(np.uint16)


def _store(array: np.ndarray) -> tuple[np.ndarray, str | None]:
    if array.dtype.name == "bfloat16":
        return array.view(_BFLOAT16_CARRIER), "bfloat16"
    return base.to_carrier(array, _NATIVE)


def _load(array: np.ndarray, logical: str | None) -> np.ndarray:
    if logical == "bfloat16":
        import ml_dtypes

        return array.view(ml_dtypes.bfloat16)
    return base.from_carrier(array, logical)


class NpzSource:
    format = "npz"
    separator = "/"

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        try:
            self._zip = zipfile.ZipFile(path)
        except zipfile.BadZipFile as e:
            raise ValueError(f"{path} is not an .npz archive: {e}") from None
        names = [n[:-4] for n in self._zip.namelist() if n.endswith(".npy")]
        self._logical: dict[str, str] = {}
        if DTYPES_MEMBER in names:
            self._logical = json.loads(str(self._read_raw(DTYPES_MEMBER)))
            names.remove(DTYPES_MEMBER)
        self._entries = []
        for name in names:
            with self._zip.open(name + ".npy") as f:
                version = np.lib.format.read_magic(f)
                read_header = (
                    np.lib.format.read_array_header_1_0
                    if version == (1, 0)
                    else np.lib.format.read_array_header_2_0
                )
                shape, _, dtype = read_header(f)  # the header only, not the data
            if name in self._logical:
                dtype = _load(np.zeros(0, dtype), self._logical[name]).dtype
            self._entries.append(base.TensorEntry(name, np.dtype(dtype), tuple(shape)))

    def _read_raw(self, name: str) -> np.ndarray:
        with self._zip.open(name + ".npy") as f:
            return np.lib.format.read_array(f, allow_pickle=False)

    def entries(self) -> list[base.TensorEntry]:
        return list(self._entries)

    def read(self, path: str) -> np.ndarray:
        return _load(self._read_raw(path), self._logical.get(path))

    def close(self) -> None:
        self._zip.close()

    def __enter__(self) -> NpzSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NpzWriter(base.WriterBase):
    def __init__(
        self, destination: str | os.PathLike, *, overwrite: bool = False, **_: Any
    ) -> None:
        self._out = base.AtomicOutput(destination, overwrite=overwrite)
        self._zip = zipfile.ZipFile(self._out.staging, "w", allowZip64=True)
        self._logical: dict[str, str] = {}
        self._names: set[str] = set()

    def write(self, path: str, array: np.ndarray) -> None:
        if path in self._names or path == DTYPES_MEMBER:
            raise ValueError(f"tensor {path} written twice or reserved")
        self._names.add(path)
        stored, logical = _store(np.asarray(array))
        if logical:
            self._logical[path] = logical
        with self._zip.open(path + ".npy", "w", force_zip64=True) as f:
            np.lib.format.write_array(f, stored, allow_pickle=False)

    def write_quantized(self, path: str, parts: dict[str, np.ndarray]) -> None:
        for key, value in base.quantized_paths(path, parts, "/").items():
            self.write(key, value)

    def commit(self) -> None:
        if self._logical:
            with self._zip.open(DTYPES_MEMBER + ".npy", "w") as f:
                np.lib.format.write_array(f, np.array(json.dumps(self._logical, sort_keys=True)))
        self._zip.close()
        self._out.commit()

    def abort(self) -> None:
        self._zip.close()
        self._out.abort()
