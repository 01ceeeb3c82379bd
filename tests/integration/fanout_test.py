"""One checkpoint spread over several real servers on loopback (client/fanout.py): the same bytes
as one server, whatever replica fails part way."""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from qmill.checkpoints.run import pipeline
from qmill.client import Client, credentials, errors, fanout
from qmill.proto.v1 import qmill_pb2 as pb
from tests.checkpoints import slow_reads

RECIPE = {
    "rules": [
        {"path_regex": r".*\.[02468]\.mlp\.weight", "qtype": "int4", "tile_size": 16},
        {"path_regex": ".*", "qtype": "int8"},
    ]
}


def _checkpoint(path):
    """12 tensors: f32 and bf16 weights of several shapes, biases (kept), an int32 (copied)."""
    rng = np.random.default_rng(6)
    tensors = {"embed.positions": np.arange(48, dtype=np.int32).reshape(6, 8)}
    for i in range(9):
        dtype = ml_dtypes.bfloat16 if i % 3 == 0 else np.float32
        shape = (32 + 16 * (i % 3), 64)
        tensors[f"layers.{i}.mlp.weight"] = rng.normal(size=shape).astype(dtype)
    for i in range(2):
        tensors[f"layers.{i}.mlp.bias"] = rng.normal(size=(32,)).astype(np.float32)
    safetensors.numpy.save_file(tensors, str(path))
    return path


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("fanout") / "model.safetensors")


@pytest.fixture(scope="module")
def servers(make_server):
    return [make_server() for _ in range(3)]


@pytest.fixture(scope="module")
def reference(source, servers, tmp_path_factory):
    """The checkpoint one server writes."""
    out = tmp_path_factory.mktemp("reference") / "one-server.safetensors"
    with Client(servers[0].address, timeout=120) as client:
        pipeline.quantize_checkpoint(source, out, RECIPE, backend=client)
    return out.read_bytes()


def _qmill_serve(port):
    """`qmill serve` in a process of its own (so it can be killed), once it answers."""
    process = subprocess.Popen(
        [sys.executable, "-m", "qmill.cli", "serve", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, "qmill serve exited"
        try:
            with Client(f"127.0.0.1:{port}", timeout=5) as client:
                client.capabilities()
            return process
        except errors.QmillError:
            time.sleep(0.2)
    process.kill()
    raise AssertionError("qmill serve did not come up")


class _KillAfterFirstAnswer:
    """A job backend that SIGKILLs the victim replica as soon as it has answered one tensor."""

    def __init__(self, client, victim_address, victim):
        self.client, self.victim_address, self.victim = client, victim_address, victim

    def quantize(self, recipe, tensors, **kwargs):
        for outcome in self.client.quantize(recipe, tensors, **kwargs):
            if self.victim.poll() is None and (
                self.client.answered_by[outcome.path] == self.victim_address
            ):
                self.victim.kill()  # no graceful shutdown: its streams are cut mid-call
                self.victim.wait(30)
            yield outcome


def test_three_replicas_write_the_checkpoint_one_server_writes(
    source, servers, reference, tmp_path
):
    out = tmp_path / "three.safetensors"
    # One tensor per replica at a time: every replica gets a share of the 11 floats.
    client = fanout.FanoutClient(",".join(s.address for s in servers), tensors_per_replica=1)
    rows = pipeline.quantize_checkpoint(source, out, RECIPE, backend=client)
    assert out.read_bytes() == reference
    assert set(client.answered_by.values()) == {s.address for s in servers}
    assert len(client.answered_by) == 11 and not client.lost and client.resent == 0
    assert {r.qtype for r in rows} == {"int4", "int8", "kept"}


def test_a_replica_killed_mid_run_costs_nothing(source, servers, reference, tmp_path, monkeypatch):
    port = _free_port()
    victim_address = f"127.0.0.1:{port}"
    victim = _qmill_serve(port)
    try:
        # The victim alone writes the reference too (and compiles every shape before the run).
        alone = tmp_path / "victim-alone.safetensors"
        with Client(victim_address, timeout=120) as client:
            pipeline.quantize_checkpoint(source, alone, RECIPE, backend=client)
        assert alone.read_bytes() == reference
        # Slow reads keep the run going well past the kill.
        slow_reads.delay_reads(monkeypatch, 0.05)
        client = fanout.FanoutClient(
            [victim_address, servers[1].address, servers[2].address], tensors_per_replica=2
        )
        out = tmp_path / "survived.safetensors"
        backend = _KillAfterFirstAnswer(client, victim_address, victim)
        pipeline.quantize_checkpoint(source, out, RECIPE, backend=backend)
    finally:
        victim.kill()
        victim.wait(30)
    assert out.read_bytes() == reference
    assert list(client.lost) == [victim_address]
    assert client.lost[victim_address].code in fanout.RETRY_ON_ANOTHER
    assert len(client.answered_by) == 11 and victim_address in client.answered_by.values()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def dying_replica():
    """A replica that takes one tensor's header and then goes away (UNAVAILABLE)."""
    taken = []

    def quantize_params(requests, context):
        for request in requests:
            if request.WhichOneof("item") == "header":
                taken.append(request.header.path)
                context.abort(grpc.StatusCode.UNAVAILABLE, "replica going away")
        yield from ()

    handler = grpc.method_handlers_generic_handler(
        "qmill.v1.Quantizer",
        {
            "QuantizeParams": grpc.stream_stream_rpc_method_handler(
                quantize_params,
                request_deserializer=pb.QuantizeParamsRequest.FromString,
                response_serializer=pb.QuantizeParamsResponse.SerializeToString,
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", taken
    server.stop(0)


def test_tensors_a_dead_replica_took_are_sent_to_the_others(
    source, servers, reference, tmp_path, dying_replica
):
    address, taken = dying_replica
    lost = []
    client = fanout.FanoutClient(
        [address, servers[1].address, servers[2].address],
        on_replica_lost=lambda a, e: lost.append((a, e.code)),
    )
    out = tmp_path / "resent.safetensors"
    pipeline.quantize_checkpoint(source, out, RECIPE, backend=client)
    assert out.read_bytes() == reference
    assert lost == [(address, "UNAVAILABLE")] and len(taken) == 1
    assert client.resent >= 1
    assert client.answered_by[taken[0]] in {servers[1].address, servers[2].address}


def test_every_replica_down_is_unavailable(source, tmp_path):
    dead = f"127.0.0.1:{_free_port()},127.0.0.1:{_free_port()}"
    with pytest.raises(errors.QmillError) as e:
        pipeline.quantize_checkpoint(
            source, tmp_path / "none.safetensors", RECIPE, backend=fanout.FanoutClient(dead)
        )
    assert e.value.code == "UNAVAILABLE" and "all 2 replicas failed" in e.value.details


def test_a_bad_request_fails_at_once_instead_of_moving_on(servers):
    client = fanout.FanoutClient([s.address for s in servers])
    bad = {"rules": [{"qtype": "int99"}]}
    with pytest.raises(errors.QmillError) as e:
        list(client.quantize(bad, [("w", np.ones((8, 8), np.float32))]))
    assert e.value.code == "INVALID_ARGUMENT" and not client.lost


def test_outcomes_stop_cleanly_when_the_caller_stops_early(servers):
    client = fanout.FanoutClient([s.address for s in servers])
    tensors = ((f"t{i}", np.full((8, 8), i + 1, np.float32)) for i in range(50))
    outcomes = client.quantize({"rules": [{"qtype": "int8"}]}, tensors)
    first = next(outcomes)
    outcomes.close()  # joins the replica threads and closes their channels
    assert first.quantized
    assert not [t for t in threading.enumerate() if t.name.startswith("qmill-fanout-")]


def test_server_lists_and_dns_names_become_replicas():
    names = {"qmill-replicas": ["10.0.0.1", "10.0.0.2", "fd00::3"]}

    def resolve(host, port):
        return names[host]

    assert fanout.parse_targets(" a:1, b:2,,a:1") == [
        fanout.Replica(address="a:1"),
        fanout.Replica(address="b:2"),
    ]
    assert fanout.parse_targets("dns:///qmill-replicas:50051", resolve=resolve) == [
        fanout.Replica(address="10.0.0.1:50051", name="qmill-replicas"),
        fanout.Replica(address="10.0.0.2:50051", name="qmill-replicas"),
        fanout.Replica(address="[fd00::3]:50051", name="qmill-replicas"),
    ]
    assert fanout.is_fanout("a:1,b:2") and fanout.is_fanout("dns:name:1")
    assert not fanout.is_fanout("host:50051")
    with pytest.raises(ValueError, match="give the port"):
        fanout.parse_targets("dns:///qmill-replicas", resolve=resolve)
    with pytest.raises(ValueError, match="names no server"):
        fanout.parse_targets(" , ")


def test_dns_names_resolve_with_getaddrinfo_to_every_address():
    # The real resolver (no stub): localhost gives 127.0.0.1 and/or ::1, each once, by IP.
    replicas = fanout.parse_targets("dns:///localhost:50051")
    assert replicas and {r.name for r in replicas} == {"localhost"}
    assert {r.address for r in replicas} <= {"127.0.0.1:50051", "[::1]:50051"}
    assert len(set(replicas)) == len(replicas)

    def unresolvable(host, port):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    with pytest.raises(ValueError, match="cannot resolve nowhere"):
        fanout.parse_targets("dns:nowhere:1", resolve=unresolvable)


def _pem(cert):
    return cert.public_bytes(serialization.Encoding.PEM)


def test_dns_replicas_check_tls_against_the_name_they_were_resolved_from(tmp_path, make_server):
    # The certificate names the service only (no IP): what a cluster's certificate looks like.
    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "qmill.test")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("qmill.test")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    (tmp_path / "cert.pem").write_bytes(_pem(cert))
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    server = make_server(tls_cert=str(tmp_path / "cert.pem"), tls_key=str(tmp_path / "key.pem"))
    port = server.address.rsplit(":", 1)[1]
    creds = credentials.Credentials(tls=True, ca_cert=_pem(cert))
    client = fanout.FanoutClient(
        f"dns:///qmill.test:{port}",
        credentials=creds,
        resolve=lambda host, p: ["127.0.0.1"] if host == "qmill.test" else [],
        timeout=60,
    )
    (outcome,) = client.quantize({"rules": [{"qtype": "int8"}]}, [("w", np.ones((8, 8)))])
    assert outcome.quantized
    # The same address without the name fails the certificate check.
    with (
        Client(f"127.0.0.1:{port}", credentials=creds, timeout=10) as plain,
        pytest.raises(errors.QmillError) as e,
    ):
        plain.capabilities()
    assert e.value.code == "UNAVAILABLE"
