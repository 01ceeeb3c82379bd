"""safetensors: one file, or a sharded set described by `*.safetensors.index.json`.

The file layout (8-byte little-endian header size, JSON header, data) is read and written here
directly: reading maps only the requested tensor's bytes, and writing streams each tensor to a
staging file, so neither side ever holds more than one tensor.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct
from typing import Any

import ml_dtypes
import numpy as np

from qmill.client.checkpoints import base

_CODES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}
_DTYPES = {np.dtype(v): k for k, v in _CODES.items()}
_SUPPORTED = frozenset(d.name for d in _DTYPES)
INDEX_NAME = "model.safetensors.index.json"


def _read_header(path: pathlib.Path) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path} is not a safetensors file (too short)")
        (size,) = struct.unpack("<Q", raw)
        if size > 100 * 2**20:
            raise ValueError(f"{path} is not a safetensors file (header of {size} bytes)")
        try:
            return json.loads(f.read(size)), 8 + size
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not a safetensors file: {e}") from None


class SafetensorsSource:
    format = "safetensors"
    separator = "."

    def __init__(self, files: list[pathlib.Path]) -> None:
        self.files = files
        self._where: dict[str, tuple[pathlib.Path, dict[str, Any], int, str | None]] = {}
        self._entries: list[base.TensorEntry] = []
        self.shard_of: dict[str, int] = {}
        for shard, path in enumerate(files):
            header, data_start = _read_header(path)
            logical = json.loads(
                (header.pop("__metadata__", None) or {}).get(base.DTYPES_KEY, "{}")
            )
            for key, info in header.items():
                if info["dtype"] not in _CODES:
                    raise ValueError(f"{path}: tensor {key} has unsupported dtype {info['dtype']}")
                dtype = np.dtype(_CODES[info["dtype"]])
                if key in logical:
                    dtype = np.dtype(getattr(ml_dtypes, logical[key], logical[key]))
                self._where[key] = (path, info, data_start, logical.get(key))
                self._entries.append(base.TensorEntry(key, dtype, tuple(info["shape"])))
                self.shard_of[key] = shard

    def entries(self) -> list[base.TensorEntry]:
        return list(self._entries)

    def read(self, path: str) -> np.ndarray:
        file, info, data_start, logical = self._where[path]
        start, end = info["data_offsets"]
        array = np.empty(info["shape"], dtype=np.dtype(_CODES[info["dtype"]]).newbyteorder("<"))
        if array.nbytes != end - start:
            raise ValueError(
                f"{file}: tensor {path} has {end - start} bytes for shape {info['shape']}"
            )
        # Straight into the array's buffer: one copy of the tensor in memory, not two.
        with open(file, "rb") as f:
            f.seek(data_start + start)
            if f.readinto(memoryview(array.reshape(-1).view(np.uint8))) != array.nbytes:
                raise ValueError(f"{file}: truncated data for tensor {path}")
        return base.from_carrier(array, logical)

    def close(self) -> None:
        return None

    def __enter__(self) -> SafetensorsSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_index(index: pathlib.Path) -> SafetensorsSource:
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} has no weight_map")
    names = list(dict.fromkeys(weight_map.values()))
    return SafetensorsSource([index.parent / n for n in names])


class _ShardWriter:
    """Streams tensors to a data file; writes header + data on finish."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self._data_path = path.with_name(path.name + ".data")
        self._data = open(self._data_path, "wb")  # noqa: SIM115 - closed in finish/abort
        self._header: dict[str, Any] = {}
        self._logical: dict[str, str] = {}
        self._offset = 0

    def add(self, key: str, array: np.ndarray) -> None:
        if key in self._header:
            raise ValueError(f"tensor {key} written twice")
        stored, logical = base.to_carrier(np.asarray(array), _SUPPORTED)
        # astype, not ascontiguousarray: the latter turns 0-d arrays into 1-d ones.
        stored = stored.astype(stored.dtype.newbyteorder("<"), order="C", copy=False)
        self._data.write(memoryview(stored.reshape(-1).view(np.uint8)))
        end = self._offset + stored.nbytes
        self._header[key] = {
            "dtype": _DTYPES[np.dtype(stored.dtype.name)],
            "shape": list(stored.shape),
            "data_offsets": [self._offset, end],
        }
        if logical:
            self._logical[key] = logical
        self._offset = end

    def finish(self) -> None:
        self._data.close()
        header = dict(self._header)
        header["__metadata__"] = {"format": "pt"}
        if self._logical:
            header["__metadata__"][base.DTYPES_KEY] = json.dumps(self._logical, sort_keys=True)
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(self.path, "wb") as out, open(self._data_path, "rb") as data:
            out.write(struct.pack("<Q", len(encoded)))
            out.write(encoded)
            shutil.copyfileobj(data, out, 16 * 2**20)
        os.unlink(self._data_path)

    @property
    def keys(self) -> list[str]:
        return list(self._header)


class SafetensorsWriter(base.WriterBase):
    """One output file, or one output shard per input shard with an index when `like` is sharded."""

    def __init__(
        self, destination: str | os.PathLike, *, like: Any = None, overwrite: bool = False
    ) -> None:
        self._out = base.AtomicOutput(destination, overwrite=overwrite)
        self._shard_of = (
            getattr(like, "shard_of", None) if isinstance(like, SafetensorsSource) else None
        )
        count = len(like.files) if self._shard_of and len(like.files) > 1 else 1
        if count == 1 and str(destination).endswith(".safetensors"):
            self._shards = [_ShardWriter(self._out.staging)]
            self._index = False
        else:
            self._out.staging.mkdir()
            names = (
                ["model.safetensors"]
                if count == 1
                else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
            )
            self._shards = [_ShardWriter(self._out.staging / n) for n in names]
            self._index = count > 1

    def _shard(self, source_path: str) -> _ShardWriter:
        index = self._shard_of.get(source_path, 0) if self._shard_of and self._index else 0
        return self._shards[index]

    def write(self, path: str, array: np.ndarray) -> None:
        self._shard(path).add(path, array)

    def write_quantized(self, path: str, parts: dict[str, np.ndarray]) -> None:
        shard = self._shard(path)
        for key, value in base.quantized_paths(path, parts, ".").items():
            shard.add(key, value)

    def commit(self) -> None:
        for shard in self._shards:
            shard.finish()
        if self._index:
            weight_map = {k: s.path.name for s in self._shards for k in s.keys}
            total = sum(s._offset for s in self._shards)
            (self._out.staging / INDEX_NAME).write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
            )
        self._out.commit()

    def abort(self) -> None:
        for shard in self._shards:
            shard._data.close()
            if shard._data_path.exists():
                shard._data_path.unlink()
        self._out.abort()
