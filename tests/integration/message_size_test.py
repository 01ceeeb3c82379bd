"""Message sizes through a real server (issue 39): a client generated from the proto with gRPC's
default options (4 MiB messages at most) receives results of any size, and a chunk over the
proto's 4 MiB is refused although the server's message limit would let it in."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from qmill.proto import recipe as recipe_proto
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc

MiB = 1024 * 1024
RECIPE = pb.QuantizeParamsRequest(
    recipe=recipe_proto.from_mapping({"rules": [{"path_regex": ".*", "qtype": "int8"}]})
)


def _requests(array: np.ndarray, chunk_bytes: int) -> list[pb.QuantizeParamsRequest]:
    data = wire.to_bytes(array)
    return [
        RECIPE,
        pb.QuantizeParamsRequest(header=wire.header_for("w/kernel", array, data)),
        *(pb.QuantizeParamsRequest(chunk=c) for c in wire.chunks(data, chunk_bytes)),
    ]


def test_a_default_grpc_client_receives_a_result_over_4_mib(server):
    array = np.random.default_rng(0).normal(size=(1280, 4096)).astype(np.float32)  # 20 MiB
    with grpc.insecure_channel(server.address) as channel:  # gRPC's defaults: 4 MiB messages
        stub = pb_grpc.QuantizerStub(channel)
        responses = list(stub.QuantizeParams(iter(_requests(array, wire.CHUNK_BYTES)), timeout=120))
    (result,) = [r.result for r in responses if r.WhichOneof("item") == "result"]
    chunks = [r.chunk for r in responses if r.WhichOneof("item") == "chunk"]
    assert all(r.ByteSize() <= 4 * MiB for r in responses)
    receiver = wire.Receiver()
    receiver.announce(*result.parts)
    for chunk in chunks:
        receiver.add(chunk)
    parts = dict(receiver.take())
    assert parts["qvalue"].shape == (1280, 4096) and parts["qvalue"].nbytes == 5 * MiB


def test_a_chunk_over_4_mib_is_refused(server):
    array = np.ones((6 * MiB // 4,), np.float32)  # one 6 MiB chunk: under the 8 MiB message limit
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.QuantizerStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.QuantizeParams(iter(_requests(array, 6 * MiB)), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"a chunk of {6 * MiB} bytes; chunks carry at most {4 * MiB} bytes" in e.value.details()
