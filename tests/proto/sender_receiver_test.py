"""The one tensor sender / receiver pair every RPC uses (proto/wire.py)."""

import ml_dtypes
import numpy as np
import pytest

from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb


def test_send_wraps_header_and_chunks_in_the_rpcs_message_and_receiver_restores_the_tensor():
    # Three chunks' worth (qmill sends 4 MiB - 1 KiB a chunk: wire.CHUNK_BYTES).
    array = np.arange(3 * wire.CHUNK_BYTES // 4, dtype=np.float32).reshape(1280, -1)
    messages = list(wire.send(pb.QuantizeParamsRequest, "header", "w/kernel", array))
    assert [m.WhichOneof("item") for m in messages] == ["header", "chunk", "chunk", "chunk"]
    assert all(m.ByteSize() <= 4 * 1024 * 1024 for m in messages)  # gRPC's default limit
    receiver = wire.Receiver()
    receiver.announce(messages[0].header)
    for message in messages[1:-1]:
        receiver.add(message.chunk)
        assert receiver.receiving and receiver.take() == []
    receiver.add(messages[-1].chunk)
    ((path, back),) = receiver.take()
    assert path == "w/kernel" and not receiver.receiving
    np.testing.assert_array_equal(back, array)


def test_parts_announced_together_complete_in_order_zero_byte_ones_at_once():
    parts = {
        "qvalue": np.array([-8, 7, 3], ml_dtypes.int4),
        "empty": np.zeros((0, 4), np.float32),
        "scale": np.array([0.5], np.float32),
    }
    headers, body = wire.encode_parts(parts)
    assert [h.path for h in headers] == list(parts)
    receiver = wire.Receiver()
    receiver.announce(*headers)
    for chunk in body:
        receiver.add(chunk)
    done = receiver.take()
    assert [p for p, _ in done] == list(parts)
    for (_, got), want in zip(done, parts.values(), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()


def test_a_chunk_outside_any_tensor_and_an_oversized_header_are_wire_errors():
    with pytest.raises(wire.WireError, match="outside") as lost:
        wire.Receiver().add(pb.TensorChunk(offset=0, data=b"x"))
    assert lost.value.code == "DATA_LOSS"
    header = wire.header_for("big", np.zeros(1024, np.float32))
    with pytest.raises(wire.WireError, match="limit") as big:
        wire.Receiver(max_bytes=1000).announce(header)
    assert big.value.code == "RESOURCE_EXHAUSTED"


def test_a_shape_whose_byte_count_wraps_64_bits_is_refused_at_the_header():
    # 2^32 x 2^32 float32 is 2^66 bytes; a 64-bit product wraps to 0 and matched byte_length=0.
    header = pb.TensorHeader(path="huge", dtype=pb.DTYPE_F32, shape=[2**32, 2**32], byte_length=0)
    with pytest.raises(wire.WireError, match="does not match") as refused:
        wire.Receiver().announce(header)
    assert refused.value.code == "INVALID_ARGUMENT"
    assert wire.byte_length(pb.DTYPE_F32, (2**32, 2**32)) == 2**66
