"""The safetensors file layout, read and written here directly (no torch, exact dtypes).

A file is an 8-byte little-endian header length N, N bytes of JSON, then the tensors' bytes,
contiguous, in `data_offsets` order; offsets are relative to the end of the header. The JSON
maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} plus an optional
"__metadata__" of string values. The header is padded with spaces to a multiple of 8 bytes.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct
from typing import Any

import ml_dtypes
import numpy as np

from qmill.checkpoints.base import dtypes, files

METADATA_KEY = "__metadata__"
# In __metadata__: JSON {tensor name: logical dtype} for tensors not stored as themselves, and
# JSON {tensor name: logical shape} for 4-bit tensors packed two codes per byte (dtypes.py).
DTYPES_KEY = "qmill.dtypes"
PACKED_KEY = "qmill.packed"
RECORD_KEYS = frozenset({DTYPES_KEY, PACKED_KEY})
# The reference implementation refuses headers larger than this; so do we.
MAX_HEADER_BYTES = 100_000_000

CODES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "C64": np.dtype(np.complex64),
    # torch.float8_e4m3fn / float8_e5m2 / float8_e8m0fnu.
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
CODE_OF = {dtype.name: code for code, dtype in CODES.items()}
NATIVE = frozenset(CODE_OF)


def read_header(path: pathlib.Path) -> tuple[dict[str, dict[str, Any]], dict[str, str], int]:
    """Returns (tensors by name in file order, __metadata__, offset where the data starts)."""
    files.require_regular_file(path)
    not_one = f"{path} is not a safetensors file"
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{not_one} (it is shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", raw)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{not_one} (its first 8 bytes announce a {length}-byte header)")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{not_one} (header: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{not_one} (its header is not a JSON object)")
    metadata = header.pop(METADATA_KEY, None) or {}
    data_bytes = size - 8 - length
    for name, info in header.items():
        _check_tensor(path, name, info, data_bytes)
    # File order: the order of the bytes on disk, so a full pass reads sequentially.
    tensors = dict(sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]))
    return tensors, metadata, 8 + length


def record_metadata(record: dtypes.Record) -> dict[str, str]:
    """The __metadata__ entries holding a shard's dtype record (none when it is empty)."""
    out = {}
    if record.dtypes:
        out[DTYPES_KEY] = json.dumps(record.dtypes, sort_keys=True)
    if record.packed:
        out[PACKED_KEY] = json.dumps(record.packed, sort_keys=True, separators=(",", ":"))
    return out


def read_record(path: pathlib.Path, metadata: dict[str, str]) -> dtypes.Record:
    """The dtype record in a file's __metadata__."""
    try:
        return dtypes.Record(
            json.loads(metadata.get(DTYPES_KEY, "{}")), json.loads(metadata.get(PACKED_KEY, "{}"))
        )
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: malformed qmill dtype record in __metadata__ ({e})") from None


def _check_tensor(path: pathlib.Path, name: str, info: Any, data_bytes: int) -> None:
    try:
        code, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
    except (TypeError, KeyError, ValueError):
        raise ValueError(f"{path}: malformed header entry for tensor {name}") from None
    if code not in CODES:
        raise ValueError(
            f"{path}: tensor {name} has dtype {code}, which qmill does not read "
            f"(it reads {', '.join(CODES)})"
        )
    expected = math.prod(int(d) for d in shape) * CODES[code].itemsize  # exact, never wraps
    if not 0 <= begin <= end <= data_bytes or end - begin != expected:
        raise ValueError(
            f"{path}: tensor {name} has data_offsets {[begin, end]} for shape {shape} "
            f"({code}) in {data_bytes} data bytes; the file is truncated or corrupt"
        )


def encode_header(
    tensors: dict[str, dict[str, Any]],
    metadata: dict[str, str],
    *,
    size: int | None = None,
    utf8_names: bool = False,
) -> bytes:
    """The 8-byte length and the JSON header, padded with spaces to a multiple of 8 or, when
    `size` is given and large enough, to exactly `size` bytes (space reserved ahead of time).

    `utf8_names` writes non-ASCII names as UTF-8, as the safetensors library does, instead of
    JSON \\u escapes (both read back the same)."""
    header: dict[str, Any] = {}
    if metadata:
        header[METADATA_KEY] = metadata
    header.update(tensors)
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=not utf8_names).encode()
    target = size if size is not None and size >= len(encoded) else len(encoded)
    encoded += b" " * (target - len(encoded) + (-target % 8))
    return struct.pack("<Q", len(encoded)) + encoded


def looks_like_safetensors(path: pathlib.Path) -> bool:
    """A cheap sniff for files without the .safetensors suffix."""
    with open(path, "rb") as f:
        raw = f.read(9)
    return len(raw) == 9 and raw[8:9] == b"{"
