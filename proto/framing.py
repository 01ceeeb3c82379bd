"""Chunk messages framed by hand: the bytes of a `message(chunk=...)` request made and read
without protobuf's copies of a 4 MiB chunk (wire.py holds the tensor bytes; this, their framing
in a message). Both give exactly what protobuf would: a message that is not a lone chunk goes to
protobuf, which decides.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb


class ChunkRequest(NamedTuple):
    """A request (or response) that carries one chunk, decoded by `chunk_decoder` without
    protobuf: answers WhichOneof and `.chunk` as the message would."""

    chunk: wire.Chunk

    def WhichOneof(self, group: str) -> str:  # protobuf's name
        return "chunk"


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _length_delimited(field: int, length: int) -> bytes:
    return _varint(field << 3 | 2) + _varint(length)


_CHUNK_OFFSET = pb.TensorChunk.DESCRIPTOR.fields_by_name["offset"].number
_CHUNK_DATA = pb.TensorChunk.DESCRIPTOR.fields_by_name["data"].number


def encoded_chunks(
    message: type, data: np.ndarray, size: int = wire.CHUNK_BYTES
) -> Iterator[bytes]:
    """chunks(data) as serialized `message(chunk=...)` requests, the bytes SerializeToString
    would give, made with one copy of each chunk's data instead of four (tobytes, the chunk
    message, the copy into the request, serializing it): for callers whose channel passes
    bytes through (client/connection.py)."""
    field = message.DESCRIPTOR.fields_by_name["chunk"].number
    for offset in range(0, len(data), size):
        piece = data[offset : offset + size]
        # Proto3 leaves out a zero offset, as SerializeToString does.
        head = _varint(_CHUNK_OFFSET << 3) + _varint(offset) if offset else b""
        head += _length_delimited(_CHUNK_DATA, len(piece))
        yield b"".join((_length_delimited(field, len(head) + len(piece)), head, piece))


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    """(value, position after it); raises IndexError past the end, ValueError when too long."""
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def chunk_decoder(message: type) -> Callable[[bytes], Any]:
    """A deserializer for `message` requests (or responses) that returns a chunk message as a
    ChunkRequest whose data is a view of the received bytes, any other message parsed as
    `message`.

    grpc hands the server (the client) each message as bytes; parsing a 4 MiB chunk with
    protobuf copies its data, and reading the field copies it again (upb), before the assembler
    copies it a third time. A message that is exactly `chunk {offset data}` (the fields in any
    order, as encoded by `encoded_chunks` or SerializeToString) skips both; anything else,
    malformed bytes included, goes to protobuf, which decides.
    """
    field = message.DESCRIPTOR.fields_by_name["chunk"].number
    parse = message.FromString

    def decode(data: bytes) -> Any:
        try:
            chunk = _chunk_request(memoryview(data), field)
        except (IndexError, ValueError):
            chunk = None
        return parse(data) if chunk is None else ChunkRequest(chunk)

    return decode


def _chunk_request(view: memoryview, field: int) -> wire.Chunk | None:
    if not view or view[0] != (field << 3 | 2):
        return None
    length, pos = _read_varint(view, 1)
    if pos + length != len(view):
        return None
    offset, data = 0, view[pos:pos]
    while pos < len(view):
        tag, pos = _read_varint(view, pos)
        if tag == _CHUNK_OFFSET << 3:
            offset, pos = _read_varint(view, pos)
        elif tag == _CHUNK_DATA << 3 | 2:
            size, pos = _read_varint(view, pos)
            if pos + size > len(view):
                return None
            data, pos = view[pos : pos + size], pos + size
        else:
            return None  # another field: protobuf parses it
    return wire.Chunk(offset, data)


def serialized(message: Any) -> bytes:
    """A message's bytes; bytes (a message encoded already, as by encoded_chunks) as they are.
    The serializer of a stream whose messages may be either."""
    return message if isinstance(message, bytes) else message.SerializeToString()
