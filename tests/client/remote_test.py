"""The client against fake servicers: decoding, and servers that break the contract.

Nothing here imports jax: these tests need only the thin client's dependencies.
"""

from __future__ import annotations

from concurrent import futures

import grpc
import numpy as np
import pytest

from qmill.client import errors, remote, streaming
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc


class FakeQuantizer(pb_grpc.QuantizerServicer):
    """Answers each tensor with fixed parts; `mode` makes it misbehave."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.paths: list[str] = []

    def QuantizeParams(self, request_iterator, context):
        for request in request_iterator:
            if request.WhichOneof("item") != "header":
                continue
            self.paths.append(request.header.path)
            qvalue = np.arange(6, dtype=np.int8).reshape(2, 3)
            data = wire.to_bytes(qvalue)
            yield pb.QuantizeParamsResponse(
                result=pb.TensorResult(
                    path=request.header.path,
                    kind=pb.RESULT_KIND_QUANTIZED,
                    how=pb.HowToQuantize(qtype="int8", channelwise_axes=[1]),
                    parts=[wire.header_for("qvalue", qvalue, data)],
                    input_bytes=request.header.byte_length,
                )
            )
            if self.mode == "cut":
                return  # ends mid-tensor: no chunks, no summary
            chunk = next(wire.chunks(data))
            if self.mode == "corrupt":
                chunk = pb.TensorChunk(offset=0, data=b"\x7f" * len(chunk.data))
            yield pb.QuantizeParamsResponse(chunk=chunk)
        if self.mode != "no-summary":
            yield pb.QuantizeParamsResponse(summary=pb.Summary(tensors_received=len(self.paths)))


@pytest.fixture
def fake():
    servicer = FakeQuantizer()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_QuantizerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


TENSORS = [("a", np.ones((2, 3), np.float32)), ("b", np.zeros((2, 3), np.float32))]


def test_outcomes_are_decoded_in_order(fake):
    servicer, address = fake
    with remote.Client(address) as client:
        outcomes = list(client.quantize({"rules": [{"qtype": "int8"}]}, TENSORS))
    assert [o.path for o in outcomes] == ["a", "b"] == servicer.paths
    assert outcomes[0].parts["qvalue"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert outcomes[0].how == {
        "qtype": "int8",
        "channelwise_axes": (1,),
        "tiled_axes": {},
        "calibration_method": "",
    }
    assert outcomes[0].output_bytes == 6


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("cut", "ended before the summary"),
        ("corrupt", "crc32c"),
        ("no-summary", "ended before the summary"),
    ],
)
def test_a_server_that_breaks_the_contract_is_data_loss(fake, mode, message):
    servicer, address = fake
    servicer.mode = mode
    with remote.Client(address) as client, pytest.raises(errors.QmillError) as e:
        list(client.quantize({"rules": [{"qtype": "int8"}]}, TENSORS))
    assert e.value.code == "DATA_LOSS" and message in e.value.details


def test_unreachable_server_is_unavailable():
    with remote.Client("127.0.0.1:1", timeout=5) as client, pytest.raises(errors.QmillError) as e:
        client.capabilities()
    assert e.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def test_decoder_handles_zero_byte_parts():
    sent = {"e": np.zeros((0, 4), np.float32)}
    decoder = streaming.ResponseDecoder(sent)
    empty = np.zeros((0, 4), np.int8)
    outcome = decoder.feed(
        pb.QuantizeParamsResponse(
            result=pb.TensorResult(
                path="e", kind=pb.RESULT_KIND_QUANTIZED, parts=[wire.header_for("qvalue", empty)]
            )
        )
    )
    assert outcome is not None and outcome.parts["qvalue"].shape == (0, 4)
    assert sent == {}
