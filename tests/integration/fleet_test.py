"""A fleet that loses nothing (issue 29): three `qmill serve` replicas sharing one PostgreSQL job
queue (a real server, tests/postgres.py) and one S3 bucket (moto on loopback).

- the runner of a job is killed with SIGKILL mid-job: another replica claims it once the lease
  (2 s here) lapses, resumes it from the partial output copied beside the destination (the
  finished tensors are not redone) and writes the bytes an uninterrupted job writes;
- a replica told to stop (SIGTERM) hands its job back at once, and another one resumes it;
- a cancel sent to a replica that does not run the job stops it;
- a tenant limit of one running job holds across the replicas, while another tenant's job runs;
- the database restarted mid-job: readiness drops while it is down, the job goes on and ends
  while it is away; its record then carries its true counts, a watch reconnects across the
  outage, and the runner logs one warning for it (issue 39).
"""

from __future__ import annotations

import pathlib
import re
import threading
import time

import pytest
from etils import epath
from grpc_health.v1 import health_pb2

from qmill.cli import main as cli
from qmill.client import errors, jobs
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server.jobs import mirror
from tests import buckets
from tests.integration import fleet

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-mlp"  # Orbax, 5 float tensors + 1 int32
INT8 = {"rules": [{"qtype": "int8"}]}
# Starts `qmill serve` processes (about 80 s for the module): out of the edit-test loop.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bucket(s3) -> str:
    return buckets.with_example(s3)


@pytest.fixture(scope="module")
def replicas(postgres, bucket, tmp_path_factory):
    started = fleet.start(
        tmp_path_factory.mktemp("fleet"), postgres.new_database(), f"s3://{bucket}/jobs"
    )
    yield started
    for replica in started:
        replica.process.terminate()  # all drain at once
    for replica in started:
        replica.stop()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> bytes:
    out = tmp_path_factory.mktemp("cli") / "ref.npz"
    assert cli.main(["quantize", str(EXAMPLE), "-o", str(out), "-q", "--format", "npz"]) == 0
    return out.read_bytes()


def _submit(replica: fleet.Replica, bucket: str, out: str, token: str = "token-a") -> pb.Job:
    base = f"s3://{bucket}/jobs/{'team-a' if token == 'token-a' else 'team-b'}"
    with replica.client(token) as client:
        return client.jobs.submit(f"{base}/tiny-mlp", f"{base}/{out}", INT8, output_format="npz")


def _wait(replica: fleet.Replica, job_id: str, done, seconds: float = 60) -> pb.Job:
    deadline = time.monotonic() + seconds
    with replica.client() as client:
        while not done(job := client.jobs.get(job_id)):
            assert time.monotonic() < deadline, job
            time.sleep(0.1)
    return job


def _finished(job: pb.Job) -> bool:
    return job.state in jobs.FINAL_STATES


def test_killed_runner_another_replica_resumes_with_the_same_bytes(replicas, bucket, reference):
    job = _submit(replicas[0], bucket, "killed.npz")
    runner = fleet.runner_of(replicas, job.job_id)
    copy = epath.Path(mirror.location(job.destination, job.job_id))
    # Kill once the copy beside the destination lists finished tensors.
    deadline = time.monotonic() + 60
    while _lines(copy / "tensors.jsonl") < 2:
        assert time.monotonic() < deadline, runner.log()[-3000:]
        time.sleep(0.05)
    runner.kill()
    others = [r for r in replicas if r is not runner]
    done = _wait(others[0], job.job_id, _finished)
    assert done.state == pb.JOB_STATE_SUCCEEDED, done.error
    assert epath.Path(job.destination).read_bytes() == reference
    # Another replica claimed it and started from the finished tensors, not from nothing.
    (finisher,) = [r for r in others if r.claimed(job.job_id)]
    resumed = re.search(rf"job {job.job_id} resumes: (\d+) tensors already done", finisher.log())
    assert resumed and int(resumed.group(1)) >= 2, finisher.log()[-3000:]
    assert not copy.exists()  # deleted with the job's end
    # The killed replica is replaced, as a Deployment would.
    replicas[replicas.index(runner)] = replacement = runner.replacement()
    replacement.wait_ready()


def _lines(log: epath.Path) -> int:
    """Lines of an object the runner rewrites meanwhile (a read across a rewrite fails)."""
    try:
        return len(log.read_text().splitlines())
    except OSError:  # not there yet, or replaced while read
        return 0


def test_a_draining_replica_hands_its_job_back(replicas, bucket, reference):
    """SIGTERM: the runner stops after its tensor and releases the job at once (no lease to
    wait for); another replica resumes it."""
    job = _submit(replicas[2], bucket, "drained.npz")
    _wait(replicas[2], job.job_id, lambda j: j.tensors_done >= 2)
    runner = fleet.runner_of(replicas, job.job_id)
    runner.process.terminate()
    replicas[replicas.index(runner)] = replacement = runner.replacement()
    runner.process.wait(30)
    assert f"job {job.job_id} handed back (server stopping)" in runner.log()
    others = [r for r in replicas if r is not replacement]
    done = _wait(others[0], job.job_id, _finished)
    assert done.state == pb.JOB_STATE_SUCCEEDED, done.error
    assert epath.Path(job.destination).read_bytes() == reference
    assert any(r.claimed(job.job_id) for r in [*others, replacement])
    replacement.wait_ready()


def test_cancel_through_a_replica_that_does_not_run_the_job(replicas, bucket):
    job = _submit(replicas[1], bucket, "cancelled.npz")
    _wait(replicas[1], job.job_id, lambda j: j.tensors_done >= 1)
    runner = fleet.runner_of(replicas, job.job_id)
    other = next(r for r in replicas if r is not runner)
    with other.client() as client:
        assert client.jobs.cancel(job.job_id).state in (
            pb.JOB_STATE_RUNNING,
            pb.JOB_STATE_CANCELLED,
        )
    done = _wait(other, job.job_id, _finished, seconds=15)
    assert done.state == pb.JOB_STATE_CANCELLED
    assert not epath.Path(job.destination).exists()
    assert not epath.Path(mirror.location(job.destination, job.job_id)).exists()


def test_tenant_limits_hold_across_replicas(replicas, bucket):
    """--max-tenant-jobs 1: team-a's three jobs run one at a time though three replicas are free;
    team-b's job runs beside them."""
    ids = [_submit(replicas[i], bucket, f"limit-{i}.npz").job_id for i in range(3)]
    ids.append(_submit(replicas[0], bucket, "limit-b.npz", token="token-b").job_id)
    most = {"team-a": 0, "team-b": 0}
    together = 0
    deadline = time.monotonic() + 90
    with replicas[2].client("token-ops") as admin:
        while True:
            listed = {j.job_id: j for j in admin.jobs.list(all_tenants=True) if j.job_id in ids}
            running = [j for j in listed.values() if j.state == pb.JOB_STATE_RUNNING]
            for tenant in most:
                count = sum(f"/{tenant}/" in j.destination for j in running)
                most[tenant] = max(most[tenant], count)
            together = max(together, len(running))
            if all(_finished(j) for j in listed.values()):
                break
            assert time.monotonic() < deadline, listed
            time.sleep(0.05)
    assert [listed[i].state for i in ids] == [pb.JOB_STATE_SUCCEEDED] * 4
    assert most == {"team-a": 1, "team-b": 1}
    assert together == 2  # the limit is per tenant, not a queue of one


def test_database_restart_mid_job(replicas, bucket, postgres, reference):
    job = _submit(replicas[0], bucket, "restart.npz")
    _wait(replicas[0], job.job_id, lambda j: j.tensors_done >= 1)
    # A watch open across the outage (issue 39: `qmill jobs watch` was cut and did not reconnect).
    events: list[pb.JobEvent] = []
    retries: list[str] = []

    def watch() -> None:
        with replicas[0].client() as client:
            events.extend(client.jobs.watch(job.job_id, on_retry=retries.append))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    deadline = time.monotonic() + 20
    while not events:
        assert time.monotonic() < deadline, "the watch did not start"
        time.sleep(0.05)
    runner = fleet.runner_of(replicas, job.job_id)
    postgres.stop()
    try:
        deadline = time.monotonic() + 20
        while replicas[0].health() != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "readiness did not drop without the database"
            time.sleep(0.2)
        assert replicas[0].health("liveness") == health_pb2.HealthCheckResponse.SERVING
        with replicas[0].client() as client, pytest.raises(errors.QmillError) as raised:
            client.jobs.get(job.job_id)
        assert raised.value.code == "UNAVAILABLE"
        assert "job database is unreachable" in raised.value.details
        # The job ends while the database is away (its lease lapsed meanwhile): issue 39's
        # record kept the progress of before the outage.
        deadline = time.monotonic() + 60
        while f"job {job.job_id} succeeded" not in runner.log():
            assert time.monotonic() < deadline, runner.log()[-3000:]
            time.sleep(0.2)
    finally:
        postgres.start()
    for replica in replicas:
        replica.wait_ready(30)
    done = _wait(replicas[1], job.job_id, _finished)
    assert done.state == pb.JOB_STATE_SUCCEEDED, done.error
    assert epath.Path(job.destination).read_bytes() == reference
    # The record's counts are the job's true ones (issue 39: progress the database could not
    # take was lost), and the watch saw the job to its end through the outage.
    assert done.tensors_done == done.tensors_total > 0 and done.bytes_done == done.bytes_total
    watcher.join(60)
    assert not watcher.is_alive() and retries, retries
    assert events[-1].job.state == pb.JOB_STATE_SUCCEEDED
    assert events[-1].job.tensors_done == done.tensors_total
    # The runner that ran it wrote its end, and no other replica took the job meanwhile (the
    # others let its runner renew its lapsed lease first); one warning per outage from the
    # runner, not one per tensor or per lease renewal, and one line when the database is back.
    assert sum(replica.claimed(job.job_id) for replica in replicas) == 1
    log = runner.log()
    assert log.count("jobs: the job database answers again") == 1, log[-3000:]
    assert log.count("jobs: the job database is unreachable since") <= 1, log[-3000:]
    assert "could not renew its lease" not in log and "progress not recorded" not in log
