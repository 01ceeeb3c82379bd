"""Batch jobs on a real server: same bytes as `qmill quantize`, idempotency, cancel, tenants,
job paths confined to each tenant's directory under --jobs-root, and a job that survives
`kill -9` of its server."""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

import pytest

from qmill.cli import main as cli
from qmill.client import Client, credentials, errors, jobs
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import auth
from tests.checkpoints import slow_reads

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "tiny-mlp")  # Orbax, 5 float tensors + 1 int32
# Every tenant's directory under the jobs root holds a copy, so jobs name it relatively.
SOURCE = "tiny-mlp"
TOKENS = {
    "token-a": {"tenant": "team-a", "role": "user"},
    "token-b": {"tenant": "team-b", "role": "user"},
    "token-ops": {"tenant": "ops", "role": "admin"},
}
INT8 = {"rules": [{"qtype": "int8"}]}


def _client(address: str, token: str | None = None) -> Client:
    creds = credentials.Credentials.from_files(token=token) if token else None
    return Client(address, timeout=30, credentials=creds)


def _wait(client: Client, job_id: str, done, seconds: float = 45.0) -> pb.Job:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        job = client.jobs.get(job_id)
        if done(job):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} never got there: {client.jobs.get(job_id)}")


def _finished(client: Client, job_id: str) -> pb.Job:
    return _wait(client, job_id, lambda j: j.state in jobs.FINAL_STATES)


def _cli_output(tmp_path: pathlib.Path, name: str, *extra: str) -> pathlib.Path:
    out = tmp_path / "cli" / name
    out.parent.mkdir(exist_ok=True)  # the CLI refuses an output folder that does not exist
    assert cli.main(["quantize", EXAMPLE, "-o", str(out), "-q", *extra]) == 0
    return out


@pytest.fixture(scope="module")
def jobs_root(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("jobs-root")
    for tenant in ("team-a", "team-b", "ops"):
        shutil.copytree(EXAMPLE, root / tenant / SOURCE)
    return root


@pytest.fixture(scope="module")
def jobs_server(make_server, tmp_path_factory, jobs_root):
    db = tmp_path_factory.mktemp("jobs") / "jobs.sqlite3"
    return make_server(
        tokens=auth.TokenTable.from_mapping(TOKENS), jobs_db=str(db), jobs_root=str(jobs_root)
    )


@pytest.fixture
def work(jobs_root, request) -> pathlib.Path:
    """A directory of team-a's for this test alone (the tests share one server and root)."""
    path = jobs_root / "team-a" / request.node.name
    path.mkdir()
    return path


@pytest.mark.parametrize("fmt", ["npz", "safetensors"])
def test_submit_and_watch_equals_qmill_quantize(jobs_server, work, tmp_path, fmt):
    name = "out.npz" if fmt == "npz" else "out.safetensors"
    dest = work / name
    with _client(jobs_server.address, "token-a") as client:
        job = client.jobs.submit(SOURCE, str(dest), INT8, output_format=fmt)
        assert job.state == pb.JOB_STATE_QUEUED and job.job_id
        events = list(client.jobs.watch(job.job_id))
    last = events[-1].job
    assert last.state == pb.JOB_STATE_SUCCEEDED, last.error
    assert (last.tensors_done, last.tensors_total) == (6, 6)
    assert [e.job.state for e in events].count(pb.JOB_STATE_SUCCEEDED) == 1
    reference = _cli_output(tmp_path, name, "--format", fmt)
    assert dest.read_bytes() == reference.read_bytes()


def test_repeated_request_id_is_the_same_job(jobs_server, work, jobs_root):
    dest = str(work / "out.npz")
    with _client(jobs_server.address, "token-a") as client:
        first = client.jobs.submit(SOURCE, dest, INT8, request_id="rid-1", output_format="npz")
        again = client.jobs.submit(SOURCE, dest, INT8, request_id="rid-1", output_format="npz")
        assert again.job_id == first.job_id
        _finished(client, first.job_id)
        with pytest.raises(errors.QmillError, match=r"ALREADY_EXISTS.*rid-1"):
            client.jobs.submit(SOURCE, dest + "2", INT8, request_id="rid-1", output_format="npz")
        ids = [j.job_id for j in client.jobs.list()]
        assert ids.count(first.job_id) == 1
    # The key is per tenant: team-b's rid-1 is another job.
    with _client(jobs_server.address, "token-b") as other:
        job_b = other.jobs.submit(SOURCE, "rid-1.npz", INT8, request_id="rid-1")
        assert job_b.job_id != first.job_id
        _finished(other, job_b.job_id)


def test_cancel_leaves_no_destination(jobs_server, work, monkeypatch):
    # The job opens its source after this: 1 s before each tensor is read.
    slow_reads.delay_reads(monkeypatch, 1)
    dest = work / "out.npz"
    with _client(jobs_server.address, "token-a") as client:
        job = client.jobs.submit(SOURCE, str(dest), INT8)
        _wait(client, job.job_id, lambda j: j.state == pb.JOB_STATE_RUNNING)
        client.jobs.cancel(job.job_id)
        job = _finished(client, job.job_id)
        # Cancelling a finished job changes nothing.
        assert client.jobs.cancel(job.job_id).state == pb.JOB_STATE_CANCELLED
    assert job.state == pb.JOB_STATE_CANCELLED
    assert job.tensors_done < job.tensors_total
    assert not dest.exists()
    assert not (work / "out.npz.qmill-partial").exists()


def test_other_tenants_jobs_are_not_found(jobs_server, work):
    with _client(jobs_server.address, "token-a") as owner:
        job = owner.jobs.submit(SOURCE, str(work / "a.npz"), INT8)
        with _client(jobs_server.address, "token-b") as other:
            for call in (other.jobs.get, other.jobs.cancel, lambda i: list(other.jobs.watch(i))):
                with pytest.raises(errors.QmillError, match="NOT_FOUND") as raised:
                    call(job.job_id)
                assert "job" in raised.value.details
            assert job.job_id not in [j.job_id for j in other.jobs.list()]
            with pytest.raises(errors.QmillError, match="PERMISSION_DENIED"):
                other.jobs.list(all_tenants=True)
        _finished(owner, job.job_id)
    with _client(jobs_server.address, "token-ops") as admin:
        assert job.job_id in [j.job_id for j in admin.jobs.list(all_tenants=True)]
        assert job.job_id not in [j.job_id for j in admin.jobs.list()]


@pytest.mark.parametrize(
    ("source", "dest", "message"),
    [
        ("gs://bucket/ckpt", "o.npz", r"INVALID_ARGUMENT.*object-store URLs \(gs://, s3://"),
        ("missing", "o.npz", "does not exist"),
        (SOURCE, "", "destination is empty"),
        (SOURCE, SOURCE, "ALREADY_EXISTS.*already exists"),
    ],
)
def test_bad_submissions_say_what_to_fix(jobs_server, source, dest, message):
    with _client(jobs_server.address, "token-a") as client:
        with pytest.raises(errors.QmillError, match=message):
            client.jobs.submit(source, dest, INT8)
        with pytest.raises(errors.QmillError, match=r"INVALID_ARGUMENT.*not a valid regex"):
            client.jobs.submit(SOURCE, "o.npz", {"rules": [{"path_regex": "("}]})


def test_an_unknown_qtype_is_refused_at_submit_not_in_the_job(jobs_server, work):
    with _client(jobs_server.address, "token-a") as client:
        before = len(client.jobs.list())
        with pytest.raises(errors.QmillError) as raised:
            client.jobs.submit(SOURCE, str(work / "o.npz"), {"rules": [{"qtype": "int99"}]})
        assert len(client.jobs.list()) == before
    assert raised.value.code == "INVALID_ARGUMENT"
    assert "'int99' is not a qtype" in raised.value.details
    assert "valid qtypes: " in raised.value.details and "int8" in raised.value.details


def test_a_job_that_fails_says_why(jobs_server, work):
    (work / "notes.txt").write_text("not a checkpoint")
    with _client(jobs_server.address, "token-a") as client:
        job = client.jobs.submit(str(work / "notes.txt"), str(work / "o.npz"), INT8)
        job = _finished(client, job.job_id)
    assert job.state == pb.JOB_STATE_FAILED
    assert "notes.txt" in job.error
    assert not (work / "o.npz").exists()


# --- Confinement: a tenant's job paths stay inside <jobs root>/<tenant>/ ------------------------


def test_relative_and_absolute_paths_inside_the_tenants_directory(jobs_server, jobs_root):
    team_b = jobs_root / "team-b"
    with _client(jobs_server.address, "token-b") as client:
        job = _finished(client, client.jobs.submit(SOURCE, "out/rel.npz", INT8).job_id)
        assert job.state == pb.JOB_STATE_SUCCEEDED, job.error
        # The job shows the resolved server paths.
        assert job.source == os.path.realpath(team_b / SOURCE)
        assert job.destination == os.path.realpath(team_b / "out" / "rel.npz")
        absolute = client.jobs.submit(str(team_b / SOURCE), str(team_b / "out" / "abs.npz"), INT8)
        assert _finished(client, absolute.job_id).state == pb.JOB_STATE_SUCCEEDED
    assert (team_b / "out" / "rel.npz").read_bytes() == (team_b / "out" / "abs.npz").read_bytes()


@pytest.mark.parametrize(
    ("source", "dest"),
    [
        ("../team-a/tiny-mlp", "stolen.npz"),  # another tenant's source
        ("../team-a/no-such-thing", "stolen.npz"),  # same answer: existence is not told
        ("{root}/team-a/tiny-mlp", "stolen.npz"),  # absolute, another tenant's
        ("link-to-a", "stolen.npz"),  # a symlink to another tenant's source
        ("tiny-mlp/../../team-a/tiny-mlp", "stolen.npz"),
        (SOURCE, "../team-a/planted.npz"),  # writing into another tenant's directory
        (SOURCE, "dir-of-a/planted.npz"),  # through a symlinked directory
        (SOURCE, "/tmp/planted.npz"),  # absolute outside the root: refused, not re-rooted
        (SOURCE, "."),  # the tenant's directory itself
    ],
)
def test_paths_leaving_the_tenants_directory_are_refused(jobs_server, jobs_root, source, dest):
    team_b = jobs_root / "team-b"
    for name, target in (("link-to-a", "team-a/tiny-mlp"), ("dir-of-a", "team-a")):
        if not (team_b / name).is_symlink():
            (team_b / name).symlink_to(jobs_root / target)
    source = source.replace("{root}", str(jobs_root))
    with _client(jobs_server.address, "token-b") as client:
        with pytest.raises(errors.QmillError) as raised:
            client.jobs.submit(source, dest, INT8, overwrite=True)
        assert not [j for j in client.jobs.list() if "planted" in j.destination]
    assert raised.value.code == "INVALID_ARGUMENT"
    assert "outside your jobs directory" in raised.value.details
    assert f"job paths must be in {team_b}/" in raised.value.details
    assert (
        not list(jobs_root.glob("team-a/planted*"))
        and not pathlib.Path("/tmp/planted.npz").exists()
    )


def test_a_server_with_tokens_and_no_jobs_root_refuses_server_paths(make_server, tmp_path):
    server = make_server(
        tokens=auth.TokenTable.from_mapping(TOKENS), jobs_db=str(tmp_path / "jobs.sqlite3")
    )
    with _client(server.address, "token-a") as client:
        with pytest.raises(errors.QmillError) as raised:
            client.jobs.submit(EXAMPLE, str(tmp_path / "o.npz"), INT8)
        assert client.jobs.list() == []
    assert raised.value.code == "FAILED_PRECONDITION"
    assert "--jobs-root" in raised.value.details


def test_without_auth_jobs_use_any_path(make_server, tmp_path):
    """The single-user mode (no tokens, no --jobs-root): a laptop's own paths, as today."""
    server = make_server(jobs_db=str(tmp_path / "jobs.sqlite3"))
    with _client(server.address) as client:
        job = _finished(client, client.jobs.submit(EXAMPLE, str(tmp_path / "o.npz"), INT8).job_id)
    assert job.state == pb.JOB_STATE_SUCCEEDED, job.error
    assert (tmp_path / "o.npz").exists()


def _qmill() -> list[str]:
    exe = shutil.which("qmill", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "qmill.cli"]


def _serve(
    db: pathlib.Path, env: dict[str, str], *extra: str, qmill: list[str] | None = None
) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = qmill or _qmill()  # `qmill`, or a command line that runs it
    server = subprocess.Popen(
        [*command, "serve", "--port", str(port), "--jobs-db", str(db), "--grace", "1", *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    with _client(address) as client:
        while time.monotonic() < deadline:
            try:
                client.jobs.list()
                return server, address
            except errors.QmillError:
                assert server.poll() is None, "qmill serve exited"
                time.sleep(0.2)
    server.kill()
    raise AssertionError("qmill serve did not come up")


def test_job_survives_kill_9_of_its_server(tmp_path):
    # No tokens: the one tenant is "default", its jobs in <root>/default/. The first server gets
    # the root from --jobs-root, the restarted one from $QMILL_JOBS_ROOT (the runner checks the
    # resumed job's paths against it again).
    root = tmp_path / "root"
    shutil.copytree(EXAMPLE, root / "default" / SOURCE)
    db, dest = tmp_path / "jobs.sqlite3", root / "default" / "out.npz"
    env = {**os.environ, "QMILL_DATA_DIR": str(tmp_path / "data")}
    slow = slow_reads.qmill_command(0.7)  # 0.7 s before each tensor is read
    server, address = _serve(db, env, "--jobs-root", str(root), qmill=slow)
    try:
        with _client(address) as client:
            job = client.jobs.submit(
                SOURCE, "out.npz", INT8, request_id="survivor", output_format="npz"
            )
            _wait(client, job.job_id, lambda j: j.tensors_done >= 2)
    finally:
        server.kill()
        server.wait(30)
    assert not dest.exists()
    partial = root / "default" / "out.npz.qmill-partial" / "tensors.jsonl"
    finished_before = len(partial.read_text().splitlines())
    assert 1 <= finished_before < 5

    server, address = _serve(db, {**env, "QMILL_JOBS_ROOT": str(root)})
    try:
        with _client(address) as client:
            again = client.jobs.submit(SOURCE, "out.npz", INT8, request_id="survivor")
            assert again.job_id == job.job_id
            done = _finished(client, job.job_id)
    finally:
        server.kill()
        server.wait(30)
    assert done.state == pb.JOB_STATE_SUCCEEDED, done.error
    assert dest.read_bytes() == _cli_output(tmp_path, "out.npz", "--format", "npz").read_bytes()


def test_cli_submit_watch_list_cancel(jobs_server, work, tmp_path, capsys):
    dest = work / "cli.npz"
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
