"""Tokens, roles, token file reload, TLS, mTLS and tenants from client certificates through a
real server on loopback.

Certificates are made here, at test time (no private key is committed): one CA signs a server
certificate for 127.0.0.1/localhost and client certificates (CN client, alice, bob); a second CA
signs an impostor.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import pathlib
import shutil
import time

import grpc
import numpy as np
import pytest
import safetensors.numpy
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qmill.cli import admin as admin_client
from qmill.cli import main as cli
from qmill.client import AsyncClient, Client, credentials, errors
from qmill.proto import recipe as recipe_proto
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc
from qmill.server import auth

ROOT = pathlib.Path(__file__).resolve().parents[2]
INT8 = {"rules": [{"qtype": "int8"}]}
TOKENS = {
    "user-a-token-0123456789": {"tenant": "team-a", "role": "user"},
    "user-b-token-0123456789": {"tenant": "team-b", "role": "user"},
    "admin-token-0123456789": {"tenant": "ops", "role": "admin"},
}


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject, key, issuer, issuer_key, *, ca=False, san=None, usage=None):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(directory, name, cert, key=None):
    (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        (directory / f"{name}.key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca_key, other_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    _write(d, "ca", _cert("qmill test CA", ca_key, "qmill test CA", ca_key, ca=True))
    _write(d, "other-ca", _cert("other CA", other_key, "other CA", other_key, ca=True))
    server_key = ec.generate_private_key(ec.SECP256R1())
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server = _cert(
        "qmill", server_key, "qmill test CA", ca_key, san=san, usage=ExtendedKeyUsageOID.SERVER_AUTH
    )
    _write(d, "server", server, server_key)
    for name, issuer, issuer_key in (
        ("client", "qmill test CA", ca_key),
        ("alice", "qmill test CA", ca_key),
        ("bob", "qmill test CA", ca_key),
        ("impostor", "other CA", other_key),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(name, key, issuer, issuer_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
        _write(d, name, cert, key)
    return d


@pytest.fixture(scope="module")
def token_server(make_server):
    return make_server(tokens=auth.TokenTable.from_mapping(TOKENS))


def _caps(address, creds):
    with Client(address, timeout=30, credentials=creds) as client:
        return client.capabilities()


def _server_info(address, token):
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.AdminStub(channel).GetServerInfo(
            pb.GetServerInfoRequest(), metadata=[("authorization", f"Bearer {token}")], timeout=30
        )


@pytest.mark.parametrize(
    ("token", "message"),
    [(None, "missing bearer token"), ("user-a-token-01234567890", "invalid or revoked token")],
)
def test_missing_or_wrong_token_is_unauthenticated(token_server, token, message):
    with pytest.raises(errors.QmillError) as e:
        _caps(token_server.address, credentials.Credentials(token=token))
    assert e.value.code == "UNAUTHENTICATED" and message in e.value.details
    # Streams too: the interceptor covers every RPC, not a list of them.
    creds = credentials.Credentials(token=token)
    with (
        Client(token_server.address, credentials=creds) as c,
        pytest.raises(errors.QmillError) as e,
    ):
        list(c.quantize(INT8, [("w", np.ones((4, 4), np.float32))]))
    assert e.value.code == "UNAUTHENTICATED"


def test_other_schemes_than_bearer_are_refused(token_server):
    with grpc.insecure_channel(token_server.address) as channel:
        stub = pb_grpc.QuantizerStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            stub.GetCapabilities(
                pb.GetCapabilitiesRequest(),
                metadata=[("authorization", "Basic user-a-token-0123456789")],
                timeout=30,
            )
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_valid_token_quantizes(token_server):
    creds = credentials.Credentials(token="user-b-token-0123456789")
    with Client(token_server.address, timeout=60, credentials=creds) as client:
        assert "int8" in client.capabilities().qtypes
        (outcome,) = client.quantize(INT8, [("w/kernel", np.ones((8, 8), np.float32))])
    assert outcome.quantized


def test_the_token_comes_from_the_environment_by_default(token_server, monkeypatch):
    monkeypatch.setenv(credentials.TOKEN_ENV, "user-a-token-0123456789")
    with Client(token_server.address, timeout=30) as client:
        assert client.capabilities().qmill_version


def test_admin_only_operation_needs_the_admin_role(token_server):
    with pytest.raises(grpc.RpcError) as e:
        _server_info(token_server.address, "user-a-token-0123456789")
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "needs an admin token" in e.value.details()
    info = _server_info(token_server.address, "admin-token-0123456789")
    assert info.max_inflight_bytes == token_server.server.config.max_inflight_bytes
    assert info.max_concurrent_streams == token_server.server.config.max_concurrent_streams
    assert (info.inflight_bytes, info.waiting_calls, dict(info.inflight_bytes_by_tenant)) == (
        0,
        0,
        {},
    )


def test_qmill_admin_info_prints_the_load_readably_or_as_json(token_server, capsys, monkeypatch):
    monkeypatch.delenv(credentials.TOKEN_ENV, raising=False)
    args = ["admin", "info", "--server", token_server.address]
    assert cli.main([*args, "--token", "admin-token-0123456789"]) == 0
    out = capsys.readouterr().out
    limit = token_server.server.config.max_inflight_bytes
    assert f"in-flight bytes: 0 of {limit:,} (peak" in out and "calls waiting for room: 0" in out
    assert "streams: 0 open of 64" in out
    assert cli.main([*args, "--json", "--token", "admin-token-0123456789"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["max_inflight_bytes"] == limit and info["inflight_bytes_by_tenant"] == {}
    assert set(info) == {f.name for f in pb.ServerInfo.DESCRIPTOR.fields}
    # A user token: refused in one line, exit 1.
    assert cli.main([*args, "--token", "user-a-token-0123456789"]) == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().err


def test_described_info_shows_tenants_and_unlimited():
    info = pb.ServerInfo(inflight_bytes=30, inflight_bytes_by_tenant={"b": 10, "a": 20})
    lines = admin_client.describe(info)
    assert lines[0].startswith("in-flight bytes: 30 of unlimited")
    assert lines[1:3] == ["  tenant a: 20 of unlimited", "  tenant b: 10 of unlimited"]


def _eventually(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


def _answers(address, token) -> str:
    try:
        _caps(address, credentials.Credentials(token=token))
    except errors.QmillError as e:
        return e.code
    return "OK"


def test_token_file_changes_apply_without_a_restart(make_server, tmp_path):
    path = tmp_path / "tokens.json"

    def write(mapping):
        (tmp_path / "next.json").write_text(json.dumps(mapping))
        (tmp_path / "next.json").replace(path)

    write({"old-token-0123456789": {"tenant": "a"}})
    running = make_server(tokens=auth.TokenFile(path))
    assert _answers(running.address, "old-token-0123456789") == "OK"
    assert _answers(running.address, "new-token-0123456789") == "UNAUTHENTICATED"
    # Added: the new token works within a second or so, on the same server.
    both = {"old-token-0123456789": {"tenant": "a"}, "new-token-0123456789": {"tenant": "b"}}
    write(both)
    _eventually(lambda: _answers(running.address, "new-token-0123456789") == "OK")
    # A broken edit keeps both working; removing one revokes it.
    write("{not json")
    time.sleep(1.2)
    assert _answers(running.address, "old-token-0123456789") == "OK"
    assert _answers(running.address, "new-token-0123456789") == "OK"
    write({"new-token-0123456789": {"tenant": "b"}})
    _eventually(lambda: _answers(running.address, "old-token-0123456789") == "UNAUTHENTICATED")
    assert _answers(running.address, "new-token-0123456789") == "OK"


def test_health_needs_no_token_and_reflection_is_off(token_server):
    with grpc.insecure_channel(token_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=30
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflect = channel.stream_stream(
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.RpcError) as e:
            list(reflect(iter([b""]), timeout=30))
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.fixture(scope="module")
def tls_server(make_server, pki):
    return make_server(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"))


@pytest.fixture(scope="module")
def mtls_server(make_server, pki):
    return make_server(
        tls_cert=str(pki / "server.pem"),
        tls_key=str(pki / "server.key"),
        client_ca=str(pki / "ca.pem"),
        tokens=auth.TokenTable.from_mapping(TOKENS),
    )


def test_tls_works_with_the_right_ca_only(tls_server, pki):
    creds = credentials.Credentials.from_files(tls_ca=pki / "ca.pem")
    with Client(tls_server.address, timeout=30, credentials=creds) as client:
        assert client.capabilities().qmill_version
        (outcome,) = client.quantize(INT8, [("w/kernel", np.ones((8, 8), np.float32))])
    assert outcome.quantized
    plaintext = credentials.Credentials()
    wrong_ca = credentials.Credentials.from_files(tls_ca=pki / "other-ca.pem")
    for bad in (plaintext, wrong_ca):
        with pytest.raises(errors.QmillError) as e:
            _caps(tls_server.address, bad)
        assert e.value.code == "UNAVAILABLE"


@pytest.mark.parametrize("client_cert", [None, "impostor"])
def test_mtls_refuses_clients_without_a_certificate_from_its_ca(mtls_server, pki, client_cert):
    files = {"tls_ca": pki / "ca.pem", "token": "user-a-token-0123456789"}
    if client_cert:
        files |= {"tls_cert": pki / f"{client_cert}.pem", "tls_key": pki / f"{client_cert}.key"}
    creds = credentials.Credentials.from_files(**files)
    with (
        Client(mtls_server.address, timeout=30, credentials=creds) as client,
        pytest.raises(errors.QmillError) as e,
    ):
        client.capabilities()
    assert e.value.code == "UNAVAILABLE"


def test_mtls_client_with_certificate_and_token_through_the_cli(
    mtls_server, pki, capsys, monkeypatch
):
    monkeypatch.delenv(credentials.TOKEN_ENV, raising=False)
    args = ["capabilities", "--server", mtls_server.address, "--tls-ca", str(pki / "ca.pem")]
    args += ["--tls-cert", str(pki / "client.pem"), "--tls-key", str(pki / "client.key")]
    assert cli.main([*args, "--token", "admin-token-0123456789"]) == 0
    assert "qtypes:" in capsys.readouterr().out
    # mTLS does not replace the token: a good certificate with no token is still refused.
    assert cli.main(args) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_async_client_sends_the_token_and_request_id(token_server):
    import asyncio

    async def run(token):
        creds = credentials.Credentials(token=token, request_id="async-1")
        async with AsyncClient(token_server.address, timeout=60, credentials=creds) as c:
            caps = await c.capabilities()
            outcomes = [o async for o in c.quantize(INT8, [("w/kernel", np.ones((8, 8)))])]
            return caps, outcomes

    caps, (outcome,) = asyncio.run(run("user-a-token-0123456789"))
    assert caps.qtypes and outcome.quantized
    with pytest.raises(errors.QmillError) as e:
        asyncio.run(run("not-a-token"))
    assert e.value.code == "UNAUTHENTICATED"


@pytest.fixture(scope="module")
def cert_tenant_server(make_server, pki, tmp_path_factory):
    jobs_root = tmp_path_factory.mktemp("jobs-root")
    for tenant in ("alice", "bob"):
        shutil.copytree(ROOT / "examples" / "tiny-mlp", jobs_root / tenant / "ckpt")
    return make_server(
        tls_cert=str(pki / "server.pem"),
        tls_key=str(pki / "server.key"),
        client_ca=str(pki / "ca.pem"),
        tokens=auth.TokenTable.from_mapping(TOKENS),
        tenant_from_client_cert=True,
        jobs_root=str(jobs_root),
    )


def _cert_client(address, pki, name, token=None):
    creds = credentials.Credentials.from_files(
        tls_ca=pki / "ca.pem",
        tls_cert=pki / f"{name}.pem",
        tls_key=pki / f"{name}.key",
        token=token,
        environ={},
    )
    return Client(address, credentials=creds, timeout=30)


def _cert_channel(address, pki, name, token=None):
    return _cert_client(address, pki, name, token).channel


def _code(fn) -> str:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code().name
    return "OK"


def test_client_certificates_name_tenants_that_cannot_see_each_other(cert_tenant_server, pki):
    address = cert_tenant_server.address
    data = safetensors.numpy.save({"w": np.arange(64, dtype=np.float32).reshape(8, 8)})
    recipe = recipe_proto.from_mapping(INT8)
    with (
        contextlib.closing(_cert_channel(address, pki, "alice")) as alice,
        contextlib.closing(_cert_channel(address, pki, "bob")) as bob,
    ):
        with _cert_client(address, pki, "alice") as client:
            upload_id = client.upload(data).upload_id
        job = pb_grpc.JobsStub(alice).SubmitJob(
            pb.SubmitJobRequest(source="ckpt", destination="out.npz", recipe=recipe),
            timeout=30,
        )
        query = pb.QueryUploadRequest(upload_id=upload_id)
        get = pb.GetJobRequest(job_id=job.job_id)
        for who, want in ((alice, "OK"), (bob, "NOT_FOUND")):
            uploads_stub, jobs_stub = pb_grpc.UploadsStub(who), pb_grpc.JobsStub(who)
            assert _code(lambda: uploads_stub.QueryUpload(query, timeout=30)) == want  # noqa: B023
            assert _code(lambda: jobs_stub.GetJob(get, timeout=30)) == want  # noqa: B023
        listed = pb_grpc.JobsStub(bob).ListJobs(pb.ListJobsRequest(), timeout=30).jobs
        assert job.job_id not in [j.job_id for j in listed]
        # The certificate makes a user: server-wide operations still need an admin token.
        info = pb.GetServerInfoRequest()
        assert _code(lambda: pb_grpc.AdminStub(alice).GetServerInfo(info, timeout=30)) == (
            "PERMISSION_DENIED"
        )
    # A token, when sent, decides over the certificate.
    with contextlib.closing(
        _cert_channel(address, pki, "alice", token="admin-token-0123456789")
    ) as ops:
        assert pb_grpc.AdminStub(ops).GetServerInfo(info, timeout=30).max_inflight_bytes
    with contextlib.closing(_cert_channel(address, pki, "alice", token="not-a-token")) as wrong:
        assert _code(lambda: pb_grpc.AdminStub(wrong).GetServerInfo(info, timeout=30)) == (
            "UNAUTHENTICATED"
        )
