"""Batch jobs spread over replicas (--job-peers), all real servers on 127.0.0.1: the checkpoint
is the one `qmill quantize` writes in-process, byte for byte; a dead peer's tensors go to the
others; with every peer dead the job fails and says why."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from qmill.cli import jobs as cli_jobs
from qmill.cli import main as cli
from qmill.cli import serve
from qmill.client import Client
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import config as config_lib
from qmill.server.jobs import peers

INT8 = {"rules": [{"qtype": "int8"}]}


def _closed_port() -> str:
    """An address nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _finished(client: Client, job_id: str) -> pb.Job:
    """The job once final: WatchJob's stream ends with it."""
    return list(client.jobs.watch(job_id))[-1].job


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Twelve (64, 32) kernels and their biases: enough tensors for two peers to share."""
    path = tmp_path_factory.mktemp("peers-src") / "model.npz"
    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(12):
        tensors[f"params/Dense_{i}/kernel"] = rng.standard_normal((64, 32), np.float32)
        tensors[f"params/Dense_{i}/bias"] = rng.standard_normal((32,), np.float32)
    np.savez(path, **tensors)
    return path


@pytest.fixture(scope="module")
def expected(source, tmp_path_factory):
    """What `qmill quantize` writes in-process."""
    out = tmp_path_factory.mktemp("peers-cli") / "model-int8.npz"
    assert cli.main(["quantize", str(source), "-o", str(out), "--recipe", "int8", "-q"]) == 0
    return out.read_bytes()


def _run_job(make_server, source, destination, job_peers: str) -> pb.Job:
    server = make_server(job_peers=job_peers)
    with Client(server.address, timeout=30) as client:
        submitted = client.jobs.submit(str(source), str(destination), INT8, output_format="npz")
        return _finished(client, submitted.job_id)


def test_a_job_spreads_over_two_peers_and_writes_the_cli_checkpoint(
    make_server, source, expected, tmp_path
):
    first, second = make_server(), make_server()
    job = _run_job(make_server, source, tmp_path / "out.npz", f"{first.address},{second.address}")
    assert job.state == pb.JOB_STATE_SUCCEEDED, job.error
    assert "over 2 peers" in job.message, job.message
    for peer in (first, second):  # each answered a share of the 12 kernels
        assert f"{peer.address}: " in job.message
    assert (tmp_path / "out.npz").read_bytes() == expected


def test_a_dead_peer_is_dropped_and_the_others_finish_the_job(
    make_server, source, expected, tmp_path
):
    alive = make_server()
    dead = _closed_port()
    job = _run_job(make_server, source, tmp_path / "out.npz", f"{dead},{alive.address}")
    assert job.state == pb.JOB_STATE_SUCCEEDED, job.error
    # All 24 tensors (the kept biases are answered too) by the one peer left.
    assert f"over 1 peer ({alive.address}: 24 tensors; lost {dead})" in job.message
    assert (tmp_path / "out.npz").read_bytes() == expected


def test_with_every_peer_dead_the_job_fails_and_names_the_cause(make_server, source, tmp_path):
    job = _run_job(make_server, source, tmp_path / "out.npz", _closed_port())
    assert job.state == pb.JOB_STATE_FAILED
    assert "UNAVAILABLE" in job.error or "unavailable" in job.error.lower(), job.error
    assert not (tmp_path / "out.npz").exists()


@pytest.mark.parametrize(
    ("spec", "message"),
    [(",", "names no server"), ("dns:///qmill-replicas", "give the port")],
)
def test_a_malformed_peer_list_stops_the_server_at_start(spec, message):
    with pytest.raises(ValueError, match=message):
        peers.backend_factory(config_lib.ServerConfig(job_peers=spec), serve.job_peer_backends)


def test_a_server_built_without_the_fan_out_client_refuses_job_peers():
    # The server never imports the client: --job-peers works only when the composition root
    # (qmill serve, qmill.cli.serve) hands it the fan-out client, and says so otherwise.
    with pytest.raises(ValueError, match="job_peer_backends"):
        peers.backend_factory(config_lib.ServerConfig(job_peers="127.0.0.1:1"))


def test_peers_get_the_peer_token_never_the_servers_own(monkeypatch):
    monkeypatch.setenv("QMILL_TOKEN", "the-servers-own-client-token")
    monkeypatch.delenv(config_lib.JOB_PEER_TOKEN_ENV, raising=False)
    make = peers.backend_factory(
        config_lib.ServerConfig(job_peers="127.0.0.1:1"), serve.job_peer_backends
    )
    assert make()._credentials.token is None
    monkeypatch.setenv(config_lib.JOB_PEER_TOKEN_ENV, "peer-token")
    make = peers.backend_factory(
        config_lib.ServerConfig(job_peers="127.0.0.1:1"), serve.job_peer_backends
    )
    assert make()._credentials.token == "peer-token"


def test_the_cli_shows_how_a_finished_jobs_tensors_were_shared(make_server, source, tmp_path):
    peer = make_server()
    server = make_server(job_peers=peer.address)
    submit = ["submit", "--server", server.address, str(source), str(tmp_path / "o.npz")]
    assert cli.main([*submit, "--recipe", "int8", "--watch"]) == 0
    with Client(server.address, timeout=30) as client:
        (job,) = client.jobs.list()
    line = cli_jobs.describe(job)
    assert line.endswith(f"over 1 peer ({peer.address}: 24 tensors))"), line
