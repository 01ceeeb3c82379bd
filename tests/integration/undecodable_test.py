"""Bytes that are not protobuf get INVALID_ARGUMENT and one log line (issue 18, item 6).

grpc.aio answers a request it cannot decode with INTERNAL and logs a traceback (341 of them in
one fuzz run). Every RPC kind is tried with a message that is not valid protobuf: a field tag
of 0 is never valid, and a truncated length-delimited field cannot be parsed either.
"""

from __future__ import annotations

import logging

import grpc
import pytest

from qmill.client import Client

GARBAGE = [b"\x00\x00\x00", b"\x0a\xff\xff\xff\x0f"]  # tag 0; field 1 claiming 4 GiB of bytes
CALLS = [
    ("unary_unary", "/qmill.v1.Quantizer/GetCapabilities"),
    ("unary_stream", "/qmill.v1.OdmlExporter/ExportOdml"),
    ("stream_unary", "/qmill.v1.Uploads/Upload"),
    ("stream_stream", "/qmill.v1.Quantizer/QuantizeParams"),
    ("stream_stream", "/qmill.v1.Calibrator/Calibrate"),
]


def _call(channel: grpc.Channel, kind: str, method: str, data: bytes) -> None:
    rpc = getattr(channel, kind)(method)  # no serializers: the bytes go as they are
    if kind == "unary_unary":
        rpc(data, timeout=10)
    elif kind == "unary_stream":
        list(rpc(data, timeout=10))
    elif kind == "stream_unary":
        rpc(iter([data]), timeout=10)
    else:
        list(rpc(iter([data]), timeout=10))


@pytest.mark.parametrize("data", GARBAGE)
@pytest.mark.parametrize(("kind", "method"), CALLS)
def test_undecodable_bytes_are_invalid_argument_without_a_traceback(
    server, caplog, kind, method, data
):
    caplog.set_level(logging.INFO)
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as refused:
        _call(channel, kind, method, data)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert "not valid protobuf" in refused.value.details()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    with Client(server.address, timeout=30) as client:  # and the server still serves
        assert client.capabilities().qtypes
