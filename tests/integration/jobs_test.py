"""Batch jobs on a real server: same bytes as `qmill quantize`, idempotency, cancel, tenants,
and a job that survives `kill -9` of its server."""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

import pytest

from qmill.client import cli, credentials, errors, jobs
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import auth

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = str(ROOT / "examples" / "tiny-mlp")  # Orbax, 5 float tensors + 1 int32
TOKENS = {
    "token-a": {"tenant": "team-a", "role": "user"},
    "token-b": {"tenant": "team-b", "role": "user"},
    "token-ops": {"tenant": "ops", "role": "admin"},
}
INT8 = {"rules": [{"qtype": "int8"}]}


def _client(address: str, token: str | None = None) -> jobs.JobsClient:
    creds = credentials.Credentials.from_files(token=token) if token else None
    return jobs.JobsClient(address, timeout=30, credentials=creds)


def _wait(client: jobs.JobsClient, job_id: str, done, seconds: float = 45.0) -> pb.Job:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        job = client.get(job_id)
        if done(job):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} never got there: {client.get(job_id)}")


def _cli_output(tmp_path: pathlib.Path, name: str, *extra: str) -> pathlib.Path:
    out = tmp_path / "cli" / name
    assert cli.main(["quantize", SOURCE, "-o", str(out), "-q", *extra]) == 0
    return out


@pytest.fixture(scope="module")
def jobs_server(make_server, tmp_path_factory):
    db = tmp_path_factory.mktemp("jobs") / "jobs.sqlite3"
    return make_server(tokens=auth.TokenTable.from_mapping(TOKENS), jobs_db=str(db))


@pytest.mark.parametrize("fmt", ["npz", "safetensors"])
def test_submit_and_watch_equals_qmill_quantize(jobs_server, tmp_path, fmt):
    name = "out.npz" if fmt == "npz" else "out.safetensors"
    dest = tmp_path / name
    with _client(jobs_server.address, "token-a") as client:
        job = client.submit(SOURCE, str(dest), INT8, output_format=fmt)
        assert job.state == pb.JOB_STATE_QUEUED and job.job_id
        events = list(client.watch(job.job_id))
    last = events[-1].job
    assert last.state == pb.JOB_STATE_SUCCEEDED, last.error
    assert (last.tensors_done, last.tensors_total) == (6, 6)
    assert [e.job.state for e in events].count(pb.JOB_STATE_SUCCEEDED) == 1
    reference = _cli_output(tmp_path, name, "--format", fmt)
    assert dest.read_bytes() == reference.read_bytes()


def test_repeated_request_id_is_the_same_job(jobs_server, tmp_path):
    dest = str(tmp_path / "out.npz")
    with _client(jobs_server.address, "token-a") as client:
        first = client.submit(SOURCE, dest, INT8, request_id="rid-1", output_format="npz")
        again = client.submit(SOURCE, dest, INT8, request_id="rid-1", output_format="npz")
        assert again.job_id == first.job_id
        _wait(client, first.job_id, lambda j: j.state in jobs.FINAL_STATES)
        with pytest.raises(errors.QmillError, match=r"ALREADY_EXISTS.*rid-1"):
            client.submit(SOURCE, dest + "2", INT8, request_id="rid-1", output_format="npz")
        ids = [j.job_id for j in client.list()]
        assert ids.count(first.job_id) == 1
    # The key is per tenant: team-b's rid-1 is another job.
    with _client(jobs_server.address, "token-b") as other:
        job_b = other.submit(SOURCE, str(tmp_path / "b.npz"), INT8, request_id="rid-1")
        assert job_b.job_id != first.job_id
        _wait(other, job_b.job_id, lambda j: j.state in jobs.FINAL_STATES)


def test_cancel_leaves_no_destination(jobs_server, tmp_path, monkeypatch):
    # The runner reads the test-only delay when a job starts: 1 s before each tensor.
    monkeypatch.setenv("QMILL_TEST_TENSOR_DELAY", "1")
    dest = tmp_path / "out.npz"
    with _client(jobs_server.address, "token-a") as client:
        job = client.submit(SOURCE, str(dest), INT8)
        _wait(client, job.job_id, lambda j: j.state == pb.JOB_STATE_RUNNING)
        client.cancel(job.job_id)
        job = _wait(client, job.job_id, lambda j: j.state in jobs.FINAL_STATES)
        # Cancelling a finished job changes nothing.
        assert client.cancel(job.job_id).state == pb.JOB_STATE_CANCELLED
    assert job.state == pb.JOB_STATE_CANCELLED
    assert job.tensors_done < job.tensors_total
    assert not dest.exists()
    assert not (tmp_path / "out.npz.qmill-partial").exists()


def test_other_tenants_jobs_are_not_found(jobs_server, tmp_path):
    with _client(jobs_server.address, "token-a") as owner:
        job = owner.submit(SOURCE, str(tmp_path / "a.npz"), INT8)
        with _client(jobs_server.address, "token-b") as other:
            for call in (other.get, other.cancel, lambda i: list(other.watch(i))):
                with pytest.raises(errors.QmillError, match="NOT_FOUND") as raised:
                    call(job.job_id)
                assert "job" in raised.value.details
            assert job.job_id not in [j.job_id for j in other.list()]
            with pytest.raises(errors.QmillError, match="PERMISSION_DENIED"):
                other.list(all_tenants=True)
        _wait(owner, job.job_id, lambda j: j.state in jobs.FINAL_STATES)
    with _client(jobs_server.address, "token-ops") as admin:
        assert job.job_id in [j.job_id for j in admin.list(all_tenants=True)]
        assert job.job_id not in [j.job_id for j in admin.list()]


@pytest.mark.parametrize(
    ("source", "dest", "message"),
    [
        ("gs://bucket/ckpt", "{tmp}/o.npz", "object-store URLs are not supported"),
        ("{tmp}/missing", "{tmp}/o.npz", "does not exist"),
        (SOURCE, "", "destination is empty"),
        (SOURCE, str(ROOT / "examples"), "already exists"),
    ],
)
def test_bad_submissions_say_what_to_fix(jobs_server, tmp_path, source, dest, message):
    with _client(jobs_server.address, "token-a") as client:
        with pytest.raises(errors.QmillError, match=message):
            client.submit(
                source.replace("{tmp}", str(tmp_path)), dest.replace("{tmp}", str(tmp_path)), INT8
            )
        with pytest.raises(errors.QmillError, match=r"INVALID_ARGUMENT.*not a valid regex"):
            client.submit(SOURCE, str(tmp_path / "o.npz"), {"rules": [{"path_regex": "("}]})


def test_a_job_that_fails_says_why(jobs_server, tmp_path):
    with _client(jobs_server.address, "token-a") as client:
        job = client.submit(SOURCE, str(tmp_path / "o.npz"), {"rules": [{"qtype": "int99"}]})
        job = _wait(client, job.job_id, lambda j: j.state in jobs.FINAL_STATES)
    assert job.state == pb.JOB_STATE_FAILED
    assert "int99" in job.error
    assert not (tmp_path / "o.npz").exists()


def _qmill() -> list[str]:
    exe = shutil.which("qmill", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "qmill.client.cli"]


def _serve(db: pathlib.Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [*_qmill(), "serve", "--port", str(port), "--jobs-db", str(db), "--grace", "1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    with _client(address) as client:
        while time.monotonic() < deadline:
            try:
                client.list()
                return server, address
            except errors.QmillError:
                assert server.poll() is None, "qmill serve exited"
                time.sleep(0.2)
    server.kill()
    raise AssertionError("qmill serve did not come up")


def test_job_survives_kill_9_of_its_server(tmp_path):
    db, dest = tmp_path / "jobs.sqlite3", tmp_path / "out.npz"
    env = {**os.environ, "QMILL_DATA_DIR": str(tmp_path / "data")}
    server, address = _serve(db, {**env, "QMILL_TEST_TENSOR_DELAY": "0.7"})
    try:
        with _client(address) as client:
            job = client.submit(SOURCE, str(dest), INT8, request_id="survivor", output_format="npz")
            _wait(client, job.job_id, lambda j: j.tensors_done >= 2)
    finally:
        server.kill()
        server.wait(30)
    assert not dest.exists()
    partial = tmp_path / "out.npz.qmill-partial" / "tensors.jsonl"
    finished_before = len(partial.read_text().splitlines())
    assert 1 <= finished_before < 5

    server, address = _serve(db, env)
    try:
        with _client(address) as client:
            assert (
                client.submit(
                    SOURCE, str(dest), INT8, request_id="survivor", output_format="npz"
                ).job_id
                == job.job_id
            )
            done = _wait(client, job.job_id, lambda j: j.state in jobs.FINAL_STATES)
    finally:
        server.kill()
        server.wait(30)
    assert done.state == pb.JOB_STATE_SUCCEEDED, done.error
    assert dest.read_bytes() == _cli_output(tmp_path, "out.npz", "--format", "npz").read_bytes()


def test_cli_submit_watch_list_cancel(jobs_server, tmp_path, capsys):
    dest = tmp_path / "cli.npz"
    common = ["--server", jobs_server.address, "--token", "token-a"]
    args = ["submit", SOURCE, str(dest), "--format", "npz", "--watch", "--request-id", "cli-1"]
    assert cli.main([*args, *common]) == 0
    out = capsys.readouterr().out
    assert "succeeded: wrote" in out and "6/6 tensors" in out
    job_id = out.split()[0]
    assert dest.read_bytes() == _cli_output(tmp_path, "ref.npz", "--format", "npz").read_bytes()
    assert cli.main(["jobs", "list", *common]) == 0
    assert job_id in capsys.readouterr().out
    assert cli.main(["jobs", "cancel", job_id, *common]) == 0  # already done: stays succeeded
    assert "succeeded" in capsys.readouterr().out
    assert cli.main(["jobs", "watch", "no-such-job", *common]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
