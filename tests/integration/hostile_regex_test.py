"""A recipe regex cannot freeze the server (issue 18, item 1): real server on 127.0.0.1.

`(a+)+$` against 40 a's and a '!' takes 2^40 steps in a backtracking engine; it used to hold the
event loop, so health checks timed out for half a minute. Path regexes are now matched in linear
time (RE2): the call finishes, and the health service answers within its 1 s deadline meanwhile.
"""

from __future__ import annotations

import threading

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qmill.proto import recipe as recipe_proto
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc


def _requests(path_regex: str, tensor_path: str):
    recipe = recipe_proto.from_mapping({"rules": [{"path_regex": path_regex, "qtype": "int8"}]})
    yield pb.QuantizeParamsRequest(recipe=recipe)
    yield from wire.send(
        pb.QuantizeParamsRequest, "header", tensor_path, np.ones((8, 8), np.float32)
    )


def test_a_catastrophic_regex_neither_stalls_the_call_nor_the_health_service(server):
    with grpc.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        stub = pb_grpc.QuantizerStub(channel)
        answers: list = []
        call = threading.Thread(
            target=lambda: answers.extend(
                stub.QuantizeParams(_requests("(a+)+$", "a" * 40 + "!"), timeout=60)
            )
        )
        call.start()
        for _ in range(5):
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        call.join(60)
        assert not call.is_alive()
    (result,) = [a.result for a in answers if a.WhichOneof("item") == "result"]
    # No rule matched the path, so the tensor was kept, with the reason.
    assert result.kind == pb.RESULT_KIND_KEPT and result.path == "a" * 40 + "!"


def test_a_backtracking_only_regex_is_refused_as_invalid_argument(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.QuantizerStub(channel)
        try:
            list(stub.QuantizeParams(_requests(r"(?=kernel).*", "w/kernel"), timeout=30))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "lookahead" in e.details()
        else:
            raise AssertionError("a lookahead regex was accepted")
