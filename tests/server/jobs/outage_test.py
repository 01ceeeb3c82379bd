"""A job that runs, and ends, while its database is away (issue 39): its final record carries
its true counts, the log says so once per outage (and once when the database is back), and the
runner does not try the database for every tensor meanwhile."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import errors
from qmill.server.jobs import outage as outage_lib
from qmill.server.jobs import paths as paths_lib
from qmill.server.jobs import runner as runner_lib
from qmill.server.jobs import sqlite_store
from qmill.server.jobs import store as store_lib
from tests.server.jobs import records

TENSORS = 60


class AwayStore:
    """A SQLite store whose database goes away at the job's first progress update and comes
    back once the job's final state has been refused `refusals` times."""

    shared = False

    def __init__(self, path, refusals: int = 2) -> None:
        self._store = sqlite_store.SqliteJobStore(path)
        self.away = False
        self.tried_while_away = 0  # store calls that found it away
        self._refusals = refusals
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._store, name)

    def _away(self, name: str) -> None:
        with self._lock:
            if self.away:
                self.tried_while_away += 1
                raise errors.Unavailable(f"the job database is unreachable ({name}); retry")

    def update(self, job_id, *, owner=None, **fields):
        with self._lock:
            if fields.get("tensors_done") == 1 and "state" not in fields:
                self.away = True
            if self.away and "state" in fields:
                self._refusals -= 1
                if self._refusals < 0:
                    self.away = False
        self._away("update")
        return self._store.update(job_id, owner=owner, **fields)

    def renew(self, job_id, owner, *, lease_seconds):
        self._away("renew")
        return self._store.renew(job_id, owner, lease_seconds=lease_seconds)

    def claim(self, owner, **kwargs):
        self._away("claim")
        return self._store.claim(owner, **kwargs)


def test_a_job_that_ends_while_the_database_is_away_keeps_its_true_counts(tmp_path, caplog):
    root = tmp_path / "root"
    (root / "team-a").mkdir(parents=True)
    rng = np.random.default_rng(0)
    arrays = {
        f"layer{i}/kernel": rng.normal(size=(32, 64)).astype(np.float32) for i in range(TENSORS)
    }
    np.savez(root / "team-a" / "params.npz", **arrays)
    store = AwayStore(tmp_path / "jobs.sqlite3")
    record, _ = records.create(store, tenant="team-a", source="params.npz", destination="out.npz")
    runner = runner_lib.JobRunner(
        store, paths=paths_lib.PathPolicy(jobs_root=str(root), multi_tenant=True)
    )
    caplog.set_level(logging.INFO, logger="qmill.server.jobs")
    runner.start()
    try:
        deadline = time.monotonic() + 120
        while (job := store.get(record.job_id)).state not in store_lib.FINAL:
            assert time.monotonic() < deadline, job
            time.sleep(0.05)
    finally:
        runner.stop()
    assert job.state == pb.JOB_STATE_SUCCEEDED, job.error
    assert (job.tensors_done, job.tensors_total) == (TENSORS, TENSORS)
    assert job.bytes_done == job.bytes_total == TENSORS * 32 * 64 * 4
    assert (root / "team-a" / "out.npz").exists()
    # The database was away for most of the job: a warning once, a line when it was back.
    lines = [r.getMessage() for r in caplog.records]
    away = [line for line in lines if "unreachable" in line or "not recorded" in line]
    back = [line for line in lines if "answers again" in line]
    assert len(away) == 1 and "progress is held" in away[0], lines
    assert len(back) == 1, lines
    # Not a try per tensor: the progress writes waited for the backoff's next try.
    assert store.tried_while_away < TENSORS // 4, store.tried_while_away


def test_the_outage_logs_once_backs_off_and_logs_its_end(caplog):
    now = [100.0]
    outage = outage_lib.Outage(first_pause=0.5, max_pause=2.0, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="qmill.server.jobs.outage")
    assert outage.may_try() and not outage.away
    outage.answered()  # nothing to say while it was never away
    pauses = []
    for _ in range(5):
        outage.failed(RuntimeError("connection refused"))
        assert not outage.may_try()
        pauses.append(outage.seconds_to_next_try())
        now[0] += pauses[-1]
        assert outage.may_try()
    assert pauses == [0.5, 1.0, 2.0, 2.0, 2.0]
    # A try made before the next one was due (a lease renewal) does not put that one off.
    outage.failed(RuntimeError("connection refused"))
    now[0] += 1.0
    outage.failed(RuntimeError("connection refused"), held=False)
    assert outage.seconds_to_next_try() == 1.0
    now[0] += 1.0
    outage.held()
    outage.answered()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "unreachable since" in messages[0] and "connection refused" in messages[0]
    assert "answers again after 9.5 s; 7 progress updates were pending" in messages[1]
    assert not outage.away and outage.may_try()
    # Lapsed leases are left to their runners for a while after the outage (runner._loop).
    assert not outage.answered_for(1.0)
    now[0] += 1.0
    assert outage.answered_for(1.0)
    outage.failed(RuntimeError("again"))
    assert not outage.answered_for(0.0)  # away


def test_a_runner_never_away_takes_lapsed_leases_at_once():
    assert outage_lib.Outage().answered_for(30.0)
