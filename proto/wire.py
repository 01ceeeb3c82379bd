"""Tensor bytes on the wire: dtype names, 4-bit packing, chunking and checked reassembly.

This is the executable half of the contract in qmill/v1/qmill.proto (see its file comment for the
byte layout). Client and server both use it, so the two sides cannot disagree on a byte. It needs
numpy and ml_dtypes (for bfloat16, float8 and int4 dtypes) besides protobuf; it never imports jax.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import math
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple, TypeVar

import google_crc32c
import ml_dtypes
import numpy as np

from qmill.proto.v1 import qmill_pb2 as pb

# The largest chunk data either side accepts (the proto's "at most 4 MiB"); a bigger one is
# INVALID_ARGUMENT.
MAX_CHUNK_BYTES = 4 * 1024 * 1024
# The chunk data qmill sends: a little under MAX_CHUNK_BYTES, so that each message, framing
# included, fits gRPC's default 4 MiB limit and a client generated from the proto with default
# options receives every result (a 4 MiB chunk made a 4,194,314-byte message; issue 39).
CHUNK_BYTES = MAX_CHUNK_BYTES - 1024

M = TypeVar("M")

_NUMPY_BY_WIRE: dict[int, np.dtype] = {
    pb.DTYPE_F64: np.dtype(np.float64),
    pb.DTYPE_F32: np.dtype(np.float32),
    pb.DTYPE_F16: np.dtype(np.float16),
    pb.DTYPE_BF16: np.dtype(ml_dtypes.bfloat16),
    pb.DTYPE_BOOL: np.dtype(np.bool_),
    pb.DTYPE_INT8: np.dtype(np.int8),
    pb.DTYPE_UINT8: np.dtype(np.uint8),
    pb.DTYPE_INT16: np.dtype(np.int16),
    pb.DTYPE_UINT16: np.dtype(np.uint16),
    pb.DTYPE_INT32: np.dtype(np.int32),
    pb.DTYPE_UINT32: np.dtype(np.uint32),
    pb.DTYPE_INT64: np.dtype(np.int64),
    pb.DTYPE_UINT64: np.dtype(np.uint64),
    pb.DTYPE_INT4: np.dtype(ml_dtypes.int4),
    pb.DTYPE_UINT4: np.dtype(ml_dtypes.uint4),
    pb.DTYPE_FLOAT8_E4M3FN: np.dtype(ml_dtypes.float8_e4m3fn),
    pb.DTYPE_FLOAT8_E5M2: np.dtype(ml_dtypes.float8_e5m2),
    pb.DTYPE_FLOAT8_E4M3FNUZ: np.dtype(ml_dtypes.float8_e4m3fnuz),
    pb.DTYPE_FLOAT8_E5M2FNUZ: np.dtype(ml_dtypes.float8_e5m2fnuz),
    pb.DTYPE_FLOAT8_E4M3B11FNUZ: np.dtype(ml_dtypes.float8_e4m3b11fnuz),
    pb.DTYPE_FLOAT4_E2M1FN: np.dtype(ml_dtypes.float4_e2m1fn),
    pb.DTYPE_FLOAT8_E8M0FNU: np.dtype(ml_dtypes.float8_e8m0fnu),
    pb.DTYPE_FLOAT8_E4M3: np.dtype(ml_dtypes.float8_e4m3),
    pb.DTYPE_FLOAT8_E3M4: np.dtype(ml_dtypes.float8_e3m4),
}
_WIRE_BY_NUMPY = {v: k for k, v in _NUMPY_BY_WIRE.items()}
_PACKED = frozenset({pb.DTYPE_INT4, pb.DTYPE_UINT4, pb.DTYPE_FLOAT4_E2M1FN})


class WireError(ValueError):
    """Bytes or headers that do not follow the contract. `code` names the gRPC status to use."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.code = code


def wire_dtypes() -> tuple[int, ...]:
    """Every DType value that has a numpy equivalent."""
    return tuple(_NUMPY_BY_WIRE)


def to_numpy_dtype(wire: int) -> np.dtype:
    try:
        return _NUMPY_BY_WIRE[wire]
    except KeyError:
        raise WireError(f"unknown wire dtype {wire}; valid: {_valid_names()}") from None


def to_wire_dtype(dtype: np.dtype | type) -> int:
    dtype = np.dtype(dtype)
    if dtype.byteorder == ">":  # big-endian input is swapped to little-endian by to_bytes
        dtype = dtype.newbyteorder("<")
    try:
        return _WIRE_BY_NUMPY[dtype]
    except KeyError:
        raise WireError(
            f"dtype {np.dtype(dtype)} has no wire name; valid: {_valid_names()}"
        ) from None


def _valid_names() -> str:
    return ", ".join(pb.DType.Name(k) for k in _NUMPY_BY_WIRE)


def byte_length(wire: int, shape: tuple[int, ...]) -> int:
    """Bytes that a tensor of this dtype and shape occupies on the wire."""
    count = math.prod(int(d) for d in shape)  # exact: a 64-bit product can wrap
    if wire in _PACKED:
        return (count + 1) // 2
    return count * to_numpy_dtype(wire).itemsize


def to_bytes(array: np.ndarray) -> np.ndarray:
    """Row-major little-endian bytes of `array` as a flat uint8 array (no copy when possible),
    4-bit dtypes packed two per byte. A 4-bit tensor packed already (an object with `dtype`,
    `shape` and the flat uint8 `packed`, as checkpoints.dtypes.Packed4) gives its bytes as they
    are."""
    wire = to_wire_dtype(array.dtype)
    packed = getattr(array, "packed", None)
    if packed is not None and wire in _PACKED:
        return packed
    flat = np.ascontiguousarray(array).reshape(-1)
    if wire in _PACKED:
        nibbles = flat.view(np.uint8) & 0x0F
        if nibbles.size % 2:
            nibbles = np.concatenate([nibbles, np.zeros(1, np.uint8)])
        return nibbles[0::2] | (nibbles[1::2] << 4)
    if flat.dtype.byteorder == ">":
        flat = flat.byteswap().view(flat.dtype.newbyteorder("<"))
    return flat.view(np.uint8)


def from_bytes(
    data: bytes | bytearray | memoryview, wire: int, shape: tuple[int, ...]
) -> np.ndarray:
    """Inverse of to_bytes. The result owns or shares `data`'s buffer; it is not copied again."""
    expected = byte_length(wire, shape)
    if len(data) != expected:
        raise WireError(
            f"{len(data)} bytes for {pb.DType.Name(wire)}{list(shape)}, expected {expected}"
        )
    dtype = to_numpy_dtype(wire)
    raw = np.frombuffer(data, dtype=np.uint8)
    if wire in _PACKED:
        count = math.prod(int(d) for d in shape)  # exact: a 64-bit product can wrap
        nibbles = np.empty(raw.size * 2, np.uint8)
        nibbles[0::2] = raw & 0x0F
        nibbles[1::2] = raw >> 4
        # ml_dtypes keeps a 4-bit value in the low nibble of its byte, as packed here.
        return nibbles[:count].view(dtype).reshape(shape)
    return raw.view(dtype.newbyteorder("<")).reshape(shape)


# Alignment of assembled tensors' buffers, in bytes.
BUFFER_ALIGNMENT = 64


class _Buffers:
    """Assembly buffers of finished tensors, reused for the next tensor they fit.

    A checkpoint's tensors come in a few sizes, and a fresh buffer of tens of MB costs a page
    fault per 4 kB as it is filled (plus the kernel zeroing it): ~0.5 s of system time per GB
    received on the 2-core dev VM. A kept buffer is reused only once nothing else refers to it
    (the tensor, its views, an engine array made from it all hold a reference); `keep` bounds
    how many are kept, and release() drops them (at the end of a server's stream).
    """

    def __init__(self, keep: int = 4, min_bytes: int = 1 << 20) -> None:
        self._keep = keep
        self._min_bytes = min_bytes
        self._kept: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A 64-byte aligned uint8 array of `nbytes`, uninitialized."""
        need = nbytes + BUFFER_ALIGNMENT
        raw = None
        if need >= self._min_bytes:
            with self._lock:
                raw = self._reusable(need)
                busy = raw is None and bool(self._kept)
            if busy:
                # A finished tensor's buffer may still be held by garbage that only a collection
                # drops: jaxlib releases the host buffers it used in place from a gc callback
                # (engine/modelfree/leaf.py release_host_buffers). Missing it cost some server
                # calls a third 64 MiB buffer (bench/README.md, issue 27). Outside the lock: a
                # finalizer may take a buffer too.
                gc.collect(0)
            with self._lock:
                raw = raw if raw is not None else self._reusable(need)
                if raw is None:
                    raw = np.empty(need, np.uint8)
                    self._kept.append(raw)
                    if len(self._kept) > self._keep:
                        del self._kept[0]  # the oldest, in use or not: no longer kept
        if raw is None:
            raw = np.empty(need, np.uint8)
        start = -raw.ctypes.data % BUFFER_ALIGNMENT
        return raw[start : start + nbytes]

    def _reusable(self, need: int) -> np.ndarray | None:
        for raw in self._kept:
            # 3 references: the list, `raw` and getrefcount's argument; any more is a user.
            if need <= raw.size <= 2 * need and sys.getrefcount(raw) == 3:
                return raw
        return None

    def release(self) -> None:
        with self._lock:
            self._kept.clear()
        gc.collect(0)  # those only garbage still held (see take) are freed now, not next call


_BUFFERS = _Buffers()


def release_buffers() -> None:
    """Drops the assembly buffers kept for reuse (those still in use live on until done)."""
    _BUFFERS.release()


def crc32c(data: bytes | np.ndarray) -> int:
    # extend() takes any buffer, value() only bytes; numpy arrays avoid a copy.
    return google_crc32c.extend(0, data)


def header_for(path: str, array: np.ndarray, data: np.ndarray | None = None) -> pb.TensorHeader:
    """The header announcing `array`; pass `data` when its bytes were already computed."""
    if data is None:
        data = to_bytes(array)
    return pb.TensorHeader(
        path=path,
        dtype=to_wire_dtype(array.dtype),
        shape=list(array.shape),
        byte_length=len(data),
        crc32c=crc32c(data),
    )


def chunks(data: np.ndarray, size: int = CHUNK_BYTES) -> Iterator[pb.TensorChunk]:
    """The chunks carrying `data` (as to_bytes returns it); a zero-length tensor has none."""
    for offset in range(0, len(data), size):
        yield pb.TensorChunk(offset=offset, data=data[offset : offset + size].tobytes())


class Chunk(NamedTuple):
    """A chunk's fields read out of its message once: every read of a protobuf bytes field
    (upb) makes a new copy of it (~0.6 ms for 4 MiB)."""

    offset: int
    data: bytes | memoryview


def chunk_of(message: pb.TensorChunk | Chunk) -> Chunk:
    return message if isinstance(message, Chunk) else Chunk(message.offset, message.data)


@dataclasses.dataclass
class Assembler:
    """Collects the chunks of one announced tensor and checks them against its header."""

    header: pb.TensorHeader
    max_bytes: int | None = None
    # Makes the result of a 4-bit tensor from its packed bytes, dtype and shape instead of
    # unpacking it (a caller that stores it packed: checkpoints.dtypes.Packed4).
    packed: Callable[[np.ndarray, np.dtype, tuple[int, ...]], Any] | None = None
    _buffer: np.ndarray = dataclasses.field(init=False)
    _received: int = dataclasses.field(init=False, default=0)
    _crc: int = dataclasses.field(init=False, default=0)

    def __post_init__(self) -> None:
        h = self.header
        label = h.path or "<unnamed>"
        if any(d < 0 for d in h.shape):
            raise WireError(f"tensor {label}: negative dimension in shape {list(h.shape)}")
        expected = byte_length(h.dtype, tuple(h.shape))  # also validates the dtype
        if h.byte_length != expected:
            raise WireError(
                f"tensor {label}: byte_length {h.byte_length} does not match "
                f"{pb.DType.Name(h.dtype)}{list(h.shape)} ({expected} bytes)"
            )
        if self.max_bytes is not None and expected > self.max_bytes:
            raise WireError(
                f"tensor {label} has {expected} bytes, over this server's limit of "
                f"{self.max_bytes}; split it or raise the server's --max-tensor-bytes",
                code="RESOURCE_EXHAUSTED",
            )
        # Uninitialized (or a finished tensor's, reused): every byte is written before finish()
        # reads it (complete is checked), and a zero-filled bytearray made assembling a 32 MiB
        # tensor ~7x slower. 64-byte aligned: XLA:CPU then uses the buffer in place instead of
        # copying it (engine/leaf.py).
        self._buffer = _BUFFERS.take(expected)

    @property
    def complete(self) -> bool:
        return self._received == self.header.byte_length

    def add(self, chunk: pb.TensorChunk | Chunk) -> None:
        label = self.header.path or "<unnamed>"
        data = chunk.data  # once: each read of a message's bytes field copies them
        if chunk.offset != self._received:
            raise WireError(
                f"tensor {label}: chunk at offset {chunk.offset}, expected {self._received} "
                "(chunks lost or out of order)",
                code="DATA_LOSS",
            )
        if len(data) > MAX_CHUNK_BYTES:
            raise WireError(
                f"tensor {label}: a chunk of {len(data)} bytes; chunks carry at most "
                f"{MAX_CHUNK_BYTES} bytes (4 MiB, qmill.proto's TensorChunk)"
            )
        end = self._received + len(data)
        if end > self.header.byte_length:
            raise WireError(
                f"tensor {label}: {end} bytes received, more than the announced "
                f"{self.header.byte_length}"
            )
        piece = np.frombuffer(data, np.uint8)
        self._buffer[self._received : end] = piece
        # The array: google_crc32c takes bytes or a numpy array, not a memoryview (ChunkRequest).
        self._crc = google_crc32c.extend(self._crc, piece)
        self._received = end

    def finish(self) -> np.ndarray:
        """The tensor, once every byte arrived and the checksum matches."""
        label = self.header.path or "<unnamed>"
        if not self.complete:
            raise WireError(
                f"tensor {label}: stream ended after {self._received} of "
                f"{self.header.byte_length} bytes",
                code="DATA_LOSS",
            )
        if self._crc != self.header.crc32c:
            raise WireError(
                f"tensor {label}: crc32c {self._crc:#010x} does not match the header's "
                f"{self.header.crc32c:#010x}; the bytes were corrupted in transit",
                code="DATA_LOSS",
            )
        shape = tuple(self.header.shape)
        if self.packed is not None and self.header.dtype in _PACKED:
            return self.packed(self._buffer, to_numpy_dtype(self.header.dtype), shape)
        return from_bytes(self._buffer, self.header.dtype, shape)


def send(message: Callable[..., M], header_field: str, path: str, array: np.ndarray) -> Iterator[M]:
    """The one tensor sender: `array` as a header then its chunks, each wrapped in the RPC's own
    message (`message(**{header_field: header})`, then `message(chunk=chunk)`)."""
    data = to_bytes(array)
    yield message(**{header_field: header_for(path, array, data)})
    for chunk in chunks(data):
        yield message(chunk=chunk)


def part_bytes(
    parts: Mapping[str, np.ndarray],
) -> tuple[list[pb.TensorHeader], list[np.ndarray]]:
    """Several tensors announced at once (a result's parts): their headers, and the bytes of
    each (as to_bytes gives them), to send in this order as chunks or framing.encoded_chunks."""
    encoded = [(name, array, to_bytes(array)) for name, array in parts.items()]
    headers = [header_for(name, array, data) for name, array, data in encoded]
    return headers, [data for _, _, data in encoded]


def encode_parts(
    parts: Mapping[str, np.ndarray],
) -> tuple[list[pb.TensorHeader], Iterator[pb.TensorChunk]]:
    """Several tensors announced at once (a result's parts): their headers, and every chunk of
    the first, then of the second, and so on."""
    headers, data = part_bytes(parts)
    return headers, (chunk for piece in data for chunk in chunks(piece))


class Receiver:
    """The one tensor receiver: reassembles announced tensors from the chunks that follow.

    Headers may be announced one at a time (a tensor stream) or several at once (a result's
    parts); chunks fill them in announcement order. `take()` hands over what is complete.
    """

    def __init__(
        self,
        max_bytes: int | None = None,
        packed: Callable[[np.ndarray, np.dtype, tuple[int, ...]], Any] | None = None,
    ) -> None:
        self._max_bytes = max_bytes
        self._packed = packed  # as Assembler's
        self._pending: collections.deque[Assembler] = collections.deque()
        self._done: list[tuple[str, np.ndarray]] = []

    def announce(self, *headers: pb.TensorHeader) -> None:
        """Expects these tensors next. Raises WireError for a header that breaks the contract."""
        for header in headers:
            self.start(Assembler(header, max_bytes=self._max_bytes, packed=self._packed))

    def start(self, assembler: Assembler) -> None:
        """Expects the tensor of an assembler made by the caller (e.g. after reserving memory)."""
        self._pending.append(assembler)
        self._finish_complete()

    def add(self, chunk: pb.TensorChunk | Chunk) -> None:
        if not self._pending:
            raise WireError("a chunk arrived outside any announced tensor", code="DATA_LOSS")
        self._pending[0].add(chunk)
        self._finish_complete()

    @property
    def receiving(self) -> bool:
        """True while an announced tensor still lacks bytes."""
        return bool(self._pending)

    def take(self) -> list[tuple[str, np.ndarray]]:
        """The tensors completed since the last call, as (path, array), in order."""
        done, self._done = self._done, []
        return done

    def _finish_complete(self) -> None:
        # A zero-byte tensor has no chunks: it is complete as soon as it is announced.
        while self._pending and self._pending[0].complete:
            assembler = self._pending.popleft()
            self._done.append((assembler.header.path, assembler.finish()))
