"""The PostgreSQL job store against a real server (tests/postgres.py): the SQLite store's
behaviour (idempotency keys, listing, counts), and what only a shared queue needs: a migration
that runs once, claims that never hand one job to two runners, leases that lapse, tenant limits,
cancel marks, and a clear UNAVAILABLE while the database is down."""

from __future__ import annotations

import concurrent.futures
import time

import psycopg
import pytest

from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import errors
from qmill.server.jobs import postgres_store, store
from qmill.server.jobs.postgres_store import PostgresJobStore
from tests.server.jobs import records

INT8 = {"rules": [{"qtype": "int8"}]}


@pytest.fixture
def url(postgres) -> str:
    return postgres.new_database()


@pytest.fixture
def connect(url):
    """Opens stores on the test's database (one per replica a test plays); closes them after."""
    opened: list[PostgresJobStore] = []

    def open_store() -> PostgresJobStore:
        opened.append(PostgresJobStore(url))
        return opened[-1]

    yield open_store
    for jobs in opened:
        jobs.close()


def _create(jobs, tenant="a", request_id=""):
    return records.create(jobs, tenant=tenant, request_id=request_id, recipe=INT8)


def test_records_idempotency_listing_and_a_migration_that_runs_once(connect, url):
    first, second = connect(), connect()  # both migrate: one does
    with psycopg.connect(url) as conn:
        versions = conn.execute("SELECT version FROM qmill_schema ORDER BY version").fetchall()
    # Each migration ran once, in order, though both stores ran them.
    assert versions == [(n,) for n in range(1, len(postgres_store.MIGRATIONS) + 1)]
    job, created = _create(first, request_id="r")
    again, created_again = _create(second, request_id="r")
    assert created and not created_again and again == job
    assert job.recipe == INT8 and job.state == pb.JOB_STATE_QUEUED
    other, _ = _create(second, tenant="b", request_id="r")
    assert other.job_id != job.job_id
    assert [j.job_id for j in second.list(tenant="a")] == [job.job_id]
    assert second.find("a", "") is None and second.get("missing") is None
    assert second.counts() == {"queued": 2}


def test_a_language_model_request_and_its_report_are_kept(connect):
    jobs = connect()
    request = pb.LanguageModelCalibration(method="gptq", gptq_block_size=64).SerializeToString()
    job, _ = records.create(jobs, recipe=INT8, output_format="", language_model=request)
    jobs.update(job.job_id, calibration_report_json='{"perplexity": null}')
    kept = connect().get(job.job_id)  # another replica reads it back
    assert kept is not None and kept.language_model == request
    assert kept.to_proto().calibration_report_json == '{"perplexity": null}'
    plain, _ = _create(jobs)
    assert jobs.get(plain.job_id).language_model == b""


def test_concurrent_claims_never_share_a_job(connect):
    jobs = connect()
    ids = {_create(jobs)[0].job_id for _ in range(12)}
    runners = [connect() for _ in range(4)]

    def claim_all(i: int) -> list[str]:
        claimed = []
        while (job := runners[i].claim(f"r{i}", lease_seconds=30, tenant_limit=0)) is not None:
            claimed.append(job.job_id)
        return claimed

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        claimed = [j for part in pool.map(claim_all, range(4)) for j in part]
    assert sorted(claimed) == sorted(ids)  # each job once


def test_a_lapsed_lease_is_claimed_again_and_the_old_runner_loses_it(connect):
    jobs = connect()
    job, _ = _create(jobs)
    assert jobs.claim("old", lease_seconds=0.5, tenant_limit=0).message == "running"
    assert jobs.claim("new", lease_seconds=30, tenant_limit=0) is None
    assert jobs.renew(job.job_id, "old", lease_seconds=0.5) is store.Lease.KEPT
    time.sleep(0.7)
    # A runner back from a database outage leaves lapsed leases to their runners a while.
    assert jobs.claim("new", lease_seconds=30, tenant_limit=0, take_lapsed=False) is None
    resumed = jobs.claim("new", lease_seconds=30, tenant_limit=0)
    assert resumed.job_id == job.job_id and resumed.message == "resumed by another runner"
    assert jobs.renew(job.job_id, "old", lease_seconds=30) is store.Lease.LOST
    assert jobs.update(job.job_id, owner="old", message="stale") is None
    assert jobs.update(job.job_id, owner="new", tensors_done=1).tensors_done == 1
    jobs.release(job.job_id, "new", "handed back")
    assert jobs.get(job.job_id).state == pb.JOB_STATE_QUEUED


def test_tenant_limit_skips_to_another_tenants_job(connect):
    jobs = connect()
    a1, _ = _create(jobs, tenant="a")
    _create(jobs, tenant="a")
    b1, _ = _create(jobs, tenant="b")
    assert jobs.claim("r1", lease_seconds=30, tenant_limit=1).job_id == a1.job_id
    assert jobs.claim("r2", lease_seconds=30, tenant_limit=1).job_id == b1.job_id
    assert jobs.claim("r3", lease_seconds=30, tenant_limit=1) is None
    jobs.update(a1.job_id, owner="r1", state=pb.JOB_STATE_SUCCEEDED)
    assert jobs.claim("r3", lease_seconds=30, tenant_limit=1).tenant == "a"


def test_cancel_ends_a_queued_job_and_marks_a_running_one(connect):
    jobs = connect()
    queued, _ = _create(jobs)
    running, _ = _create(jobs)
    jobs.update(running.job_id, state=pb.JOB_STATE_RUNNING)  # not claimable: queued one first
    record, now = jobs.request_cancel(queued.job_id)
    assert now and record.state == pb.JOB_STATE_CANCELLED
    assert jobs.request_cancel(queued.job_id) == (jobs.get(queued.job_id), False)
    claimed = jobs.claim("r", lease_seconds=30, tenant_limit=0)
    assert claimed.job_id == running.job_id  # RUNNING without a lease: lapsed, claimable
    record, now = jobs.request_cancel(running.job_id)
    assert not now and (record.state, record.message) == (pb.JOB_STATE_RUNNING, "cancelling")
    assert jobs.renew(running.job_id, "r", lease_seconds=30) is store.Lease.CANCEL


def test_an_unreachable_database_is_unavailable_and_the_store_reconnects(postgres, connect):
    jobs = connect()
    job, _ = _create(jobs)
    postgres.stop()
    try:
        with pytest.raises(errors.Unavailable, match="job database is unreachable") as raised:
            jobs.get(job.job_id)
        assert errors.status_for(raised.value)[0].name == "UNAVAILABLE"
        with pytest.raises(errors.Unavailable):
            jobs.counts()
    finally:
        postgres.start()
    assert jobs.counts() == {"queued": 1}
    assert jobs.get(job.job_id) == job
