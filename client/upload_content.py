"""What an upload sends: a checkpoint as safetensors bytes, produced one tensor at a time.

The content is described up front (its size follows from the tensors' dtypes and shapes) and its
bytes are made on demand, part by part: the safetensors header, then each tensor as the checkpoint
reader returns it. Memory stays at about one tensor whatever the checkpoint's size. A content
named by its sha256 (so the server can say it already holds it) takes two passes: one to hash,
one to send, and the second is skipped when the server already has the bytes.

The bytes are those ``safetensors.numpy.save`` makes of the same tensors (a test checks it):
tensors ordered by dtype, the reference's order below, widest first, then by name; compact JSON
with UTF-8 names; the header padded with spaces to a multiple of 8 bytes; no ``__metadata__``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pathlib
from collections.abc import Callable, Iterator

import numpy as np

from qmill.checkpoints.base import protocols
from qmill.checkpoints.formats import registry as formats
from qmill.checkpoints.formats.safetensors import header as safetensors_header

# The reference implementation's dtype order (safetensors' Dtype enum); it writes the tensors of
# the last one first.
DTYPE_ORDER = (
    "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16", "I32",
    "U32", "F32", "C64", "F64", "I64", "U64",
)  # fmt: skip
_RANK = {code: i for i, code in enumerate(DTYPE_ORDER)}
# Bytes of a safetensors file read per part when the checkpoint already is one.
FILE_BLOCK_BYTES = 8 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Part:
    """``nbytes`` consecutive bytes of the content, made by ``read`` only when needed."""

    nbytes: int
    read: Callable[[], bytes | memoryview]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Content:
    """The bytes of one upload as a sequence of parts."""

    # Shown by the server (StartUploadRequest.name).
    name: str
    parts: tuple[Part, ...]

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def sha256(self) -> str:
        """Hex SHA-256 of the whole content, reading one part at a time."""
        digest = hashlib.sha256()
        for part in self.parts:
            digest.update(_checked(part))
        return digest.hexdigest()

    def chunks(self, offset: int = 0, size: int = 1024 * 1024) -> Iterator[tuple[int, bytes]]:
        """(offset, bytes) of ``size`` (the last may be shorter) from ``offset`` to the end.

        Parts wholly before ``offset`` are not read; one part and one chunk are held at a time.
        """
        if size <= 0:
            raise ValueError(f"chunk size must be positive, got {size}")
        pending = bytearray()
        start = offset
        position = 0
        for part in self.parts:
            end = position + part.nbytes
            if end <= offset:
                position = end
                continue
            view = memoryview(_checked(part))[max(0, offset - position) :]
            position = end
            while view:
                take = min(size - len(pending), len(view))
                pending += view[:take]
                view = view[take:]
                if len(pending) == size:
                    yield start, bytes(pending)
                    start += size
                    pending.clear()
        if pending:
            yield start, bytes(pending)

    def to_bytes(self) -> bytes:
        """The whole content at once (tests and small contents only)."""
        return b"".join(bytes(_checked(p)) for p in self.parts)


def _checked(part: Part) -> bytes | memoryview:
    data = part.read()
    if len(data) != part.nbytes:
        raise ValueError(
            f"the upload's content changed while it was read: a part of {part.nbytes} bytes "
            f"now has {len(data)}; check that nothing rewrites the checkpoint during an upload"
        )
    return data


def of_bytes(data: bytes, name: str = "") -> Content:
    return Content(name=name, parts=(Part(len(data), lambda: data),) if data else ())


def of_file(path: str | os.PathLike[str]) -> Content:
    """A file sent as it is, in blocks."""
    p = pathlib.Path(path)
    size = p.stat().st_size

    def block(start: int, n: int) -> Callable[[], bytes]:
        def read() -> bytes:
            with open(p, "rb") as f:
                f.seek(start)
                return f.read(n)

        return read

    parts = tuple(
        Part(min(FILE_BLOCK_BYTES, size - s), block(s, min(FILE_BLOCK_BYTES, size - s)))
        for s in range(0, size, FILE_BLOCK_BYTES)
    )
    return Content(name=p.name, parts=parts)


@contextlib.contextmanager
def open_checkpoint(path: str | os.PathLike[str]) -> Iterator[Content]:
    """A checkpoint's content as safetensors bytes: a ``.safetensors`` file as it is, an npz or
    an Orbax directory (or a safetensors set) converted tensor by tensor, keys '/'-joined tree
    paths (what the server reads). The reader stays open while the context lasts.

    Raises:
      FileNotFoundError: nothing at ``path``.
      ValueError: not a checkpoint, or a tensor of a dtype safetensors cannot hold.
    """
    p = pathlib.Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        yield of_file(p)
        return
    # Orbax sources import jax when opened (not before).
    with formats.open_source(p) as source:
        yield _converted(p.name, source)


def _code(path: str, dtype: np.dtype) -> str:
    code = safetensors_header.CODE_OF.get(np.dtype(dtype).name)
    if code not in _RANK:
        raise ValueError(
            f"tensor {path} has dtype {np.dtype(dtype).name}, which a safetensors upload cannot "
            f"hold (it takes {', '.join(DTYPE_ORDER)}); store it in one of those first"
        )
    return code


def _converted(name: str, source: protocols.TensorSource) -> Content:
    entries = sorted(
        source.entries(), key=lambda e: (-_RANK[_code(e.path, e.dtype)], e.path.encode())
    )
    header: dict[str, dict] = {}
    position = 0
    for e in entries:
        header[e.path] = {
            "dtype": _code(e.path, e.dtype),
            "shape": list(e.shape),
            "data_offsets": [position, position + e.nbytes],
        }
        position += e.nbytes
    head = safetensors_header.encode_header(header, {}, utf8_names=True)
    parts = (Part(len(head), lambda: head), *(Part(e.nbytes, _reader(source, e)) for e in entries))
    return Content(name=name, parts=parts)


def _reader(
    source: protocols.TensorSource, entry: protocols.TensorEntry
) -> Callable[[], memoryview]:
    def read() -> memoryview:
        array = np.asarray(source.read(entry.path))
        if array.dtype.name != entry.dtype.name or array.shape != tuple(entry.shape):
            raise ValueError(
                f"tensor {entry.path} reads as {array.dtype}{list(array.shape)}, but the "
                f"checkpoint lists it as {entry.dtype}{list(entry.shape)}"
            )
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        # order="C" without ascontiguousarray, which would make a 0-d array 1-d.
        return memoryview(np.asarray(array, order="C").reshape(-1).view(np.uint8))

    return read
