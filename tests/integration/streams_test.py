"""Several concurrent QuantizeParams streams from one client to one real server
(FanoutClient(streams=N)): the checkpoint is the one a single stream writes, byte for byte."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from qmill.checkpoints.run import pipeline
from qmill.client import Client, errors, fanout

RECIPE = {
    "rules": [
        {"path_regex": r".*\.[036]\.mlp\.weight", "qtype": "nf4", "tile_size": 16},
        {"path_regex": ".*", "qtype": "int8"},
    ]
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """14 tensors: f32 and bf16 weights of three shapes, biases (kept), an int32 (copied)."""
    rng = np.random.default_rng(17)
    tensors = {"embed.positions": np.arange(48, dtype=np.int32).reshape(6, 8)}
    for i in range(11):
        dtype = ml_dtypes.bfloat16 if i % 3 == 0 else np.float32
        tensors[f"layers.{i}.mlp.weight"] = rng.normal(size=(32 + 16 * (i % 3), 64)).astype(dtype)
    for i in range(2):
        tensors[f"layers.{i}.mlp.bias"] = rng.normal(size=(32,)).astype(np.float32)
    path = tmp_path_factory.mktemp("streams") / "model.safetensors"
    safetensors.numpy.save_file(tensors, str(path))
    return path


@pytest.fixture(scope="module")
def one_stream(source, server, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "out.safetensors"
    with Client(server.address, timeout=120) as client:
        rows = pipeline.quantize_checkpoint(source, out, RECIPE, backend=client)
    return out.read_bytes(), rows


@pytest.mark.parametrize("streams", [2, 4])
def test_n_streams_write_the_one_stream_checkpoint(source, server, one_stream, tmp_path, streams):
    out = tmp_path / "out.safetensors"
    # One tensor in flight per stream, so no stream can take them all while the others start.
    client = fanout.FanoutClient(
        server.address, timeout=120, streams=streams, tensors_per_replica=1
    )
    with client:
        rows = pipeline.quantize_checkpoint(source, out, RECIPE, backend=client)
    assert out.read_bytes() == one_stream[0]
    assert repr(rows) == repr(one_stream[1])  # repr: kept rows' NaN quality equals itself
    # 11 float weights and 2 biases went over the streams; more than one stream answered.
    assert len(client.answered_by_stream) == 13
    assert set(client.answered_by_stream.values()) <= set(range(streams))
    assert len(set(client.answered_by_stream.values())) > 1
    assert set(client.answered_by.values()) == {server.address}
    assert client.lost == {} and client.resent == 0


def test_a_request_error_on_one_stream_fails_the_call(server):
    # An unknown qtype is the request's fault: raised at once, not retried on another stream.
    bad = {"rules": [{"qtype": "int99"}]}
    tensors = [(f"w{i}", np.ones((8, 8), np.float32)) for i in range(4)]
    client = fanout.FanoutClient(server.address, timeout=60, streams=3)
    with client, pytest.raises(errors.QmillError) as e:
        list(client.quantize(bad, tensors))
    assert e.value.code == "INVALID_ARGUMENT"


def test_streams_below_one_are_refused():
    with pytest.raises(ValueError, match="--streams must be >= 1, got 0"):
        fanout.FanoutClient("127.0.0.1:1", streams=0)
