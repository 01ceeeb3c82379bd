"""Prometheus metrics on their own port, request ids, and the one log line per RPC."""

from __future__ import annotations

import logging
import re
import time
import urllib.request

import grpc
import numpy as np
import pytest

from qmill.client import Client, credentials, errors
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc
from qmill.server import metrics

INT8 = {"rules": [{"qtype": "int8"}]}
QUANTIZE = "qmill.v1.Quantizer/QuantizeParams"
CAPS = "qmill.v1.Quantizer/GetCapabilities"


@pytest.fixture(scope="module")
def observed(make_server):
    return make_server(metrics_port=0)


def _eventually(predicate, timeout=10.0):
    # Counters of a refused call are updated just after its status is sent; poll briefly.
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _scrape(running) -> str:
    url = f"http://127.0.0.1:{running.server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def _sample(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        metric, _, value = line.rpartition(" ")
        if metric == (f"{name}{{{want}}}" if labels else name):
            return float(value)
    raise AssertionError(f"{name}{labels} not in the scrape")


def test_scrape_counts_calls_codes_bytes_tensors_and_latency(observed):
    m = observed.server.metrics
    before = m.value("qmill_calls_total", {"rpc": QUANTIZE, "code": "OK"}) or 0
    tensors = [("a/kernel", np.ones((32, 16), np.float32)), ("a/bias", np.ones(16, np.float32))]
    with Client(observed.address, timeout=60) as client:
        outcomes = list(client.quantize(INT8, tensors))
        with pytest.raises(errors.QmillError):
            list(client.quantize({"rules": [{"qtype": "int9"}]}, tensors))
    assert [o.quantized for o in outcomes] == [True, False]
    _eventually(lambda: m.value("qmill_calls_total", {"rpc": QUANTIZE, "code": "INVALID_ARGUMENT"}))
    text = _scrape(observed)
    assert _sample(text, "qmill_calls_total", rpc=QUANTIZE, code="OK") == before + 1
    assert _sample(text, "qmill_calls_total", rpc=QUANTIZE, code="INVALID_ARGUMENT") >= 1
    # Serialized messages: at least the tensors' own bytes went in.
    assert _sample(text, "qmill_received_bytes_total", rpc=QUANTIZE) > 32 * 16 * 4 + 16 * 4
    assert _sample(text, "qmill_sent_bytes_total", rpc=QUANTIZE) > 32 * 16
    assert _sample(text, "qmill_tensors_total", result="quantized") >= 1
    assert _sample(text, "qmill_tensors_total", result="kept") >= 1
    assert _sample(text, "qmill_quantize_seconds_count") >= 1
    assert _sample(text, "qmill_inflight_bytes") == 0
    assert _sample(text, "qmill_inflight_limit_bytes") == observed.server.config.max_inflight_bytes
    assert "# TYPE qmill_device_memory_bytes gauge" in text  # samples only where JAX reports them
    assert "# TYPE qmill_jobs gauge" in text


def test_each_server_has_its_own_registry(observed, make_server):
    other = make_server()
    before = observed.server.metrics.value("qmill_calls_total", {"rpc": CAPS, "code": "OK"}) or 0
    with Client(other.address, timeout=30) as client:
        client.capabilities()
    assert other.server.metrics.value("qmill_calls_total", {"rpc": CAPS, "code": "OK"}) == 1
    after = observed.server.metrics.value("qmill_calls_total", {"rpc": CAPS, "code": "OK"}) or 0
    assert after == before


def test_jobs_gauge_follows_what_the_jobs_engine_reports():
    m = metrics.Metrics()
    m.set_jobs_by_state({"running": 2, "queued": 5})
    m.set_jobs_by_state({"running": 1, "done": 3})
    assert m.value("qmill_jobs", {"state": "running"}) == 1
    assert m.value("qmill_jobs", {"state": "done"}) == 3
    assert m.value("qmill_jobs", {"state": "queued"}) == 0


def _caps_with(address, metadata):
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.QuantizerStub(channel)
        _, call = stub.GetCapabilities.with_call(
            pb.GetCapabilitiesRequest(), metadata=metadata, timeout=30
        )
        return dict(call.trailing_metadata())


def test_request_id_is_echoed_or_generated(observed):
    assert _caps_with(observed.address, [("x-request-id", "run-42.a")])["x-request-id"] == (
        "run-42.a"
    )
    generated = _caps_with(observed.address, [])["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    # Not something that could forge log fields: replaced by a fresh id.
    forged = _caps_with(observed.address, [("x-request-id", "a b=c")])["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", forged)


def test_errors_carry_the_request_id_too_and_the_log_line_names_it(observed, caplog):
    caplog.set_level(logging.INFO, logger="qmill.server.metrics")
    creds = credentials.Credentials(request_id="bad-recipe-7")
    with Client(observed.address, timeout=30, credentials=creds) as client:
        (ok,) = client.quantize(INT8, [("w/kernel", np.ones((8, 8), np.float32))])
    assert ok.quantized
    with grpc.insecure_channel(observed.address) as channel:
        stub = pb_grpc.QuantizerStub(channel)
        bad = [pb.QuantizeParamsRequest(header=pb.TensorHeader(path="w"))]
        with pytest.raises(grpc.RpcError) as e:
            list(stub.QuantizeParams(iter(bad), metadata=[("x-request-id", "bad-7")], timeout=30))
    assert dict(e.value.trailing_metadata())["x-request-id"] == "bad-7"

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "qmill.server.metrics"]

    _eventually(lambda: any("request_id=bad-7" in line for line in lines()))
    (ok_line,) = [line for line in lines() if "request_id=bad-recipe-7" in line]
    assert f"rpc={QUANTIZE} outcome=ok code=OK" in ok_line
    assert "tensors_in=1 quantized=1 tensor_bytes_in=256" in ok_line
    (bad_line,) = [line for line in lines() if "request_id=bad-7" in line]
    assert "code=INVALID_ARGUMENT" in bad_line and "first message must be the recipe" in bad_line
