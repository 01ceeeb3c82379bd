"""Uploads through a real server: resume after a cut, crc and offset errors, tenants, dedupe."""

import hashlib

import grpc
import numpy as np
import pytest
import safetensors.numpy

from qmill.client import Client, Credentials, errors
from qmill.proto import recipe as recipe_proto
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc
from qmill.server import auth

TOKENS = {"tok-a": {"tenant": "a"}, "tok-b": {"tenant": "b"}}
A, B = [("authorization", "Bearer tok-a")], [("authorization", "Bearer tok-b")]
DATA = np.random.default_rng(0).bytes(300_000)


@pytest.fixture(scope="module")
def running(make_server, tmp_path_factory):
    server = make_server(
        tokens=auth.TokenTable.from_mapping(TOKENS),
        data_dir=str(tmp_path_factory.mktemp("data")),
        upload_quota_bytes=2_000_000,
    )
    with grpc.insecure_channel(server.address) as channel:
        yield server, channel


@pytest.fixture(scope="module")
def clients(running):
    """A Client per tenant (its token in its credentials)."""
    a = Client(running[0].address, credentials=Credentials(token="tok-a"))
    b = Client(running[0].address, credentials=Credentials(token="tok-b"))
    with a, b:
        yield {"a": a, "b": b}


def _code(call):
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code().name


def test_an_interrupted_upload_resumes_from_the_committed_offset(running, clients):
    server, channel = running
    stub = pb_grpc.UploadsStub(channel)
    uid = stub.StartUpload(pb.StartUploadRequest(total_bytes=len(DATA)), metadata=A).upload_id

    def cut():  # two chunks, then the connection "drops" (the client's iterator fails)
        for offset in (0, 65536):
            piece = DATA[offset : offset + 65536]
            yield pb.UploadRequest(
                upload_id=uid, offset=offset, data=piece, crc32c=wire.crc32c(piece)
            )
        raise ConnectionError("network gone")

    assert _code(lambda: stub.Upload(cut(), metadata=A)) in {"CANCELLED", "UNKNOWN"}
    committed = stub.QueryUpload(pb.QueryUploadRequest(upload_id=uid), metadata=A)
    # Whatever the server had committed when the call was cancelled: whole chunks only.
    assert committed.committed_bytes in {0, 65536, 131072} and not committed.complete
    status = clients["a"].upload(DATA, upload_id=uid)
    assert status.complete and status.sha256 == hashlib.sha256(DATA).hexdigest()
    blob = server.server.uploads.blob_path(status.sha256)
    assert hashlib.sha256(blob.read_bytes()).hexdigest() == hashlib.sha256(DATA).hexdigest()
    # The same bytes again are stored once: complete at StartUpload, no second blob.
    again = clients["a"].upload(DATA)
    assert again.complete and again.upload_id != uid
    assert len(list(blob.parent.iterdir())) == 1


def test_errors_over_the_wire(running, clients):
    _, channel = running
    stub = pb_grpc.UploadsStub(channel)
    uid = stub.StartUpload(pb.StartUploadRequest(total_bytes=10), metadata=A).upload_id
    bad = pb.UploadRequest(upload_id=uid, offset=0, data=b"0123", crc32c=wire.crc32c(b"x"))
    assert _code(lambda: stub.Upload(iter([bad]), metadata=A)) == "DATA_LOSS"
    skip = pb.UploadRequest(upload_id=uid, offset=4, data=b"45", crc32c=wire.crc32c(b"45"))
    assert _code(lambda: stub.Upload(iter([skip]), metadata=A)) == "OUT_OF_RANGE"
    query = pb.QueryUploadRequest(upload_id=uid)
    assert _code(lambda: stub.QueryUpload(query, metadata=B)) == "NOT_FOUND"
    big = pb.StartUploadRequest(total_bytes=3_000_000)
    assert _code(lambda: stub.StartUpload(big, metadata=A)) == "RESOURCE_EXHAUSTED"
    with pytest.raises(errors.QmillError) as info:
        clients["b"].upload(DATA, upload_id=uid)
    assert info.value.code == "NOT_FOUND"


def test_quantize_params_on_an_upload_equals_streaming_the_tensors(running, clients):
    _, channel = running
    rng = np.random.default_rng(1)
    tensors = {
        "params/Dense_0/kernel": rng.normal(size=(64, 48)).astype(np.float32),
        "params/Dense_0/bias": rng.normal(size=(48,)).astype(np.float32),
        "params/Dense_1/kernel": rng.normal(size=(48, 10)).astype(np.float32),
    }
    recipe = {"rules": [{"qtype": "int8"}]}
    uid = clients["a"].upload(safetensors.numpy.save(tensors)).upload_id
    got = {o.path: o for o in clients["a"].quantize_upload(recipe, uid)}
    assert set(got) == set(tensors)
    assert not got["params/Dense_0/bias"].quantized
    # The same tensors streamed the usual way come back bit for bit the same.
    with Client(running[0].address, credentials=Credentials(token="tok-a")) as client:
        streamed = {o.path: o for o in client.quantize(recipe, tensors.items())}
    for path in ("params/Dense_0/kernel", "params/Dense_1/kernel"):
        assert got[path].quantized and got[path].parts["qvalue"].dtype == np.int8
        for part, value in streamed[path].parts.items():
            np.testing.assert_array_equal(got[path].parts[part], value, err_msg=f"{path} {part}")
    # Another tenant's upload id is unknown; tensors after the upload id are refused.
    with pytest.raises(errors.QmillError) as info:
        list(clients["b"].quantize_upload(recipe, uid))
    assert info.value.code == "NOT_FOUND"
    stub = pb_grpc.QuantizerStub(channel)
    extra = [
        pb.QuantizeParamsRequest(recipe=recipe_proto.from_mapping(recipe)),
        pb.QuantizeParamsRequest(upload_id=uid),
        pb.QuantizeParamsRequest(header=pb.TensorHeader(path="x")),
    ]
    with pytest.raises(grpc.RpcError) as rpc:
        list(stub.QuantizeParams(iter(extra), metadata=A))
    assert rpc.value.code().name == "INVALID_ARGUMENT" and "upload_id" in rpc.value.details()


@pytest.mark.parametrize("fmt", ["orbax", "npz"])
def test_a_checkpoint_is_streamed_once_and_a_second_upload_sends_nothing(
    running, clients, tmp_path, fmt
):
    from qmill import checkpoints

    server, _ = running
    rng = np.random.default_rng(["orbax", "npz"].index(fmt) + 2)  # content new to the server
    path = tmp_path / ("ckpt" if fmt == "orbax" else "ckpt.npz")
    with checkpoints.create_writer(path, fmt) as writer:
        for i in range(4):
            writer.write(f"params/Dense_{i}/kernel", rng.normal(size=(32, 16)).astype(np.float32))
            writer.write(f"params/Dense_{i}/bias", rng.normal(size=(16,)).astype(np.float32))
        writer.write("step", np.asarray(3, np.int32))
    with checkpoints.open_source(path) as source:
        old = safetensors.numpy.save({e.path: source.read(e.path) for e in source.entries()})
    sent: list[int] = []
    first = clients["a"].upload(path, chunk_bytes=4096, on_sent=sent.append)
    assert first.complete and sum(sent) == len(old) and len(sent) == -(-len(old) // 4096)
    # The stored content is the old whole-checkpoint serialization, byte for byte.
    assert server.server.uploads.blob_path(first.sha256).read_bytes() == old
    assert first.sha256 == hashlib.sha256(old).hexdigest()
    # Content-addressed: the same checkpoint again is complete at StartUpload, nothing sent.
    sent.clear()
    again = clients["a"].upload(path, on_sent=sent.append)
    assert again.complete and again.upload_id != first.upload_id and sent == []
