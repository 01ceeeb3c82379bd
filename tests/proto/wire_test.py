"""The byte layout of the wire contract: round trips, nibble order, and every checked failure."""

import gc

import ml_dtypes
import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from qmill.proto import framing, wire
from qmill.proto.v1 import qmill_pb2 as pb

ALL_DTYPES = [wire.to_numpy_dtype(w) for w in wire.wire_dtypes()]


def _roundtrip(array: np.ndarray, chunk: int = wire.MAX_CHUNK_BYTES) -> np.ndarray:
    data = wire.to_bytes(array)
    assembler = wire.Assembler(wire.header_for("t", array, data))
    for c in wire.chunks(data, chunk):
        assembler.add(c)
    return assembler.finish()


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 3, 4)])
def test_every_dtype_round_trips_bit_exactly(dtype, shape):
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=max(1, int(np.prod(shape))), dtype=np.uint8)
    if dtype.itemsize == 1 and dtype.name not in ("int4", "uint4", "float4_e2m1fn", "bool"):
        array = raw.view(dtype)[: int(np.prod(shape))].reshape(shape)
    else:
        array = (
            rng.integers(0, 2, size=shape).astype(dtype)
            if dtype.name == "bool"
            else (rng.uniform(-6, 6, size=shape).astype(np.float32).astype(dtype))
        )
    back = _roundtrip(array, chunk=3)
    assert back.dtype == array.dtype and back.shape == array.shape
    assert back.tobytes() == array.tobytes()


def test_int4_packs_low_nibble_first():
    array = np.array([1, -2, 3], dtype=ml_dtypes.int4)
    assert bytes(wire.to_bytes(array)) == bytes([0xE1, 0x03])


def test_multibyte_values_are_little_endian():
    assert bytes(wire.to_bytes(np.array([1], np.float32).astype(">f4"))) == b"\x00\x00\x80\x3f"


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(
        dtype=st.sampled_from([np.float32, np.int8, np.uint16]),
        shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=9),
    ),
    st.integers(1, 17),
)
def test_any_chunking_reassembles(array, chunk):
    back = _roundtrip(array, chunk)
    assert back.tobytes() == array.tobytes()


def _assembler(array):
    data = wire.to_bytes(array)
    return wire.Assembler(wire.header_for("w", array, data)), list(wire.chunks(data, 8))


def test_crc_mismatch_is_data_loss():
    asm, chunks = _assembler(np.arange(10, dtype=np.float32))
    chunks[1] = pb.TensorChunk(offset=chunks[1].offset, data=b"\xff" * len(chunks[1].data))
    for c in chunks:
        asm.add(c)
    with pytest.raises(wire.WireError, match="crc32c") as e:
        asm.finish()
    assert e.value.code == "DATA_LOSS"


def test_truncated_tensor_is_data_loss():
    asm, chunks = _assembler(np.arange(10, dtype=np.float32))
    asm.add(chunks[0])
    with pytest.raises(wire.WireError, match="8 of 40 bytes") as e:
        asm.finish()
    assert e.value.code == "DATA_LOSS"


def test_out_of_order_chunk_is_data_loss():
    asm, chunks = _assembler(np.arange(10, dtype=np.float32))
    with pytest.raises(wire.WireError, match="expected 0") as e:
        asm.add(chunks[1])
    assert e.value.code == "DATA_LOSS"


def test_wrong_byte_length_is_invalid_argument():
    header = pb.TensorHeader(path="x", dtype=pb.DTYPE_F32, shape=[4], byte_length=15)
    with pytest.raises(wire.WireError, match="does not match") as e:
        wire.Assembler(header)
    assert e.value.code == "INVALID_ARGUMENT"


def test_unknown_dtype_names_the_valid_ones():
    header = pb.TensorHeader(path="x", dtype=999, shape=[4], byte_length=4)
    with pytest.raises(wire.WireError, match="DTYPE_BF16"):
        wire.Assembler(header)


def test_oversized_tensor_is_resource_exhausted():
    header = pb.TensorHeader(path="x", dtype=pb.DTYPE_F32, shape=[1024], byte_length=4096)
    with pytest.raises(wire.WireError, match="limit") as e:
        wire.Assembler(header, max_bytes=1000)
    assert e.value.code == "RESOURCE_EXHAUSTED"


def test_extra_bytes_are_refused():
    asm, _ = _assembler(np.arange(2, dtype=np.float32))
    with pytest.raises(wire.WireError, match="more than the announced"):
        asm.add(pb.TensorChunk(offset=0, data=b"\0" * 9))


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16_383, 16_384, 70_000])
@pytest.mark.parametrize("message", [pb.QuantizeParamsRequest, pb.QuantizeParamsResponse])
def test_encoded_chunks_are_the_serialized_chunk_messages(size, message):
    # Chunk and offset sizes cross the varint length boundaries (128, 16384); offset 0 is left
    # out as protobuf leaves it out; the chunk field's number differs per message.
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    encoded = list(framing.encoded_chunks(message, data, 20_000))
    expected = [message(chunk=c).SerializeToString() for c in wire.chunks(data, 20_000)]
    assert encoded == expected
    assert len(encoded) == -(-size // 20_000)


def test_encoded_chunks_reassemble_through_the_receiver():
    array = np.random.default_rng(1).normal(size=(33, 65)).astype(ml_dtypes.bfloat16)
    data = wire.to_bytes(array)
    receiver = wire.Receiver()
    receiver.announce(wire.header_for("w", array, data))
    for encoded in framing.encoded_chunks(pb.QuantizeParamsRequest, data, 1000):
        receiver.add(wire.chunk_of(pb.QuantizeParamsRequest.FromString(encoded).chunk))
    [(path, back)] = receiver.take()
    assert path == "w" and back.tobytes() == array.tobytes()


def test_a_chunk_read_once_is_checked_like_its_message():
    array = np.arange(64, dtype=np.float32)
    data = wire.to_bytes(array)
    assembler = wire.Assembler(wire.header_for("w", array, data))
    assembler.add(wire.Chunk(0, data[:100].tobytes()))
    with pytest.raises(wire.WireError, match="chunk at offset 200, expected 100") as e:
        assembler.add(wire.Chunk(200, data[200:].tobytes()))
    assert e.value.code == "DATA_LOSS"


def _assembled(array: np.ndarray) -> np.ndarray:
    data = wire.to_bytes(array)
    assembler = wire.Assembler(wire.header_for("w", array, data))
    for c in wire.chunks(data, 1 << 20):
        assembler.add(c)
    return assembler.finish()


def test_a_finished_tensors_buffer_is_reused_only_once_nothing_holds_it():
    wire.release_buffers()
    first = _assembled(np.full((512, 1024), 1.5, np.float32))  # 2 MiB: kept for reuse
    address = first.ctypes.data
    second = _assembled(np.full((512, 1024), 2.5, np.float32))
    # `first` is alive: the second tensor got a buffer of its own, and the first is intact.
    assert not np.shares_memory(first, second)
    assert (first == 1.5).all() and (second == 2.5).all()
    del first
    third = _assembled(np.full((512, 1024), 3.5, np.float32))
    assert third.ctypes.data == address  # the first's buffer, free now, was taken again
    assert third.ctypes.data % wire.BUFFER_ALIGNMENT == 0
    assert (third == 3.5).all() and (second == 2.5).all()
    view = third[:10]  # a view keeps the buffer in use, as the tensor does
    del third
    fourth = _assembled(np.full((512, 1024), 4.5, np.float32))
    assert fourth.ctypes.data != address and (view == 3.5).all()
    wire.release_buffers()


class _Cycle:
    """Garbage in a reference cycle: freed by a collection, not when its last name goes."""

    def __init__(self, held: object) -> None:
        self.held, self.me = held, self


def test_a_buffer_that_only_garbage_holds_is_reused() -> None:
    # As jaxlib holds a host buffer it used in place until its next gc callback.
    wire.release_buffers()
    gc.disable()  # else an automatic collection could free the cycle first
    try:
        first = _assembled(np.full((512, 1024), 1.5, np.float32))
        address = first.ctypes.data
        _Cycle(first)
        del first
        second = _assembled(np.full((512, 1024), 2.5, np.float32))
        assert second.ctypes.data == address
        assert (second == 2.5).all()
    finally:
        gc.enable()
        wire.release_buffers()


def test_chunk_decoder_views_chunk_requests_and_parses_the_rest() -> None:
    decode = framing.chunk_decoder(pb.QuantizeParamsRequest)
    data = np.arange(10_000, dtype=np.uint32).view(np.uint8)
    encoded = list(framing.encoded_chunks(pb.QuantizeParamsRequest, data, size=16_384))
    protobuf = pb.QuantizeParamsRequest(chunk=pb.TensorChunk(offset=7, data=b"abc"))
    requests = [*encoded, protobuf.SerializeToString()]
    chunks = [decode(r) for r in requests]
    assert all(
        isinstance(c, framing.ChunkRequest) and c.WhichOneof("item") == "chunk" for c in chunks
    )
    assert [c.chunk.offset for c in chunks] == [0, 16_384, 32_768, 7]
    joined = b"".join(bytes(c.chunk.data) for c in chunks[:3])
    assert joined == data.tobytes() and bytes(chunks[3].chunk.data) == b"abc"
    header = pb.QuantizeParamsRequest(header=pb.TensorHeader(path="w", shape=[2]))
    assert decode(header.SerializeToString()) == header
    # A chunk with a field this decoder does not know is protobuf's to parse (and keep).
    inner = b"\x18\x01" + pb.TensorChunk(offset=7, data=b"abc").SerializeToString()
    parsed = decode(b"\x1a" + bytes([len(inner)]) + inner)
    assert isinstance(parsed, pb.QuantizeParamsRequest) and parsed.chunk.data == b"abc"
    with pytest.raises(DecodeError):
        decode(b"\x1a\x05\x08")


def test_chunk_decoder_reads_response_chunks_as_the_client_receives_them() -> None:
    # The client decodes QuantizeParams responses so (client/connection.py); their chunk field
    # has another number (2) than the request's (3).
    decode = framing.chunk_decoder(pb.QuantizeParamsResponse)
    data = np.arange(5_000, dtype=np.uint16).view(np.uint8)
    result = pb.QuantizeParamsResponse(result=pb.TensorResult(path="w", input_bytes=40))
    summary = pb.QuantizeParamsResponse(summary=pb.Summary(tensors_received=1))
    chunks = [decode(r) for r in framing.encoded_chunks(pb.QuantizeParamsResponse, data, 4096)]
    assert all(
        isinstance(c, framing.ChunkRequest) and c.WhichOneof("item") == "chunk" for c in chunks
    )
    assert b"".join(bytes(c.chunk.data) for c in chunks) == data.tobytes()
    assert decode(result.SerializeToString()) == result
    assert decode(summary.SerializeToString()) == summary
    receiver = wire.Receiver()
    array = np.linspace(-1, 1, 2_500, dtype=np.float32)
    receiver.announce(wire.header_for("w", array))
    for encoded in framing.encoded_chunks(pb.QuantizeParamsResponse, wire.to_bytes(array), 4096):
        receiver.add(decode(encoded).chunk)
    [(path, received)] = receiver.take()
    assert path == "w" and received.tobytes() == array.tobytes()
