"""Batch jobs kept in SQLite, so they survive a server restart: the store of one server.

One table: a job's request (source, destination, recipe, format, overwrite), its owner tenant
and idempotency key, its state and its progress counters. One server owns the file, so it needs
no leases: a job RUNNING when the server starts was its own before it died, and is queued again
(recover); a cancel of the running job is a flag in memory, read by the one runner.

SQLite is used from the RPCs' threads and the runner thread; every call takes one lock and is
short (one row), so neither waits long.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sqlite3
import threading
import time
import uuid
from typing import Any

from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server.jobs import store
from qmill.server.jobs.store import COLUMNS as _COLUMNS
from qmill.server.jobs.store import JobRecord

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    tenant TEXT NOT NULL,
    request_id TEXT NOT NULL,
    source TEXT NOT NULL,
    destination TEXT NOT NULL,
    recipe_json TEXT NOT NULL,
    output_format TEXT NOT NULL,
    overwrite INTEGER NOT NULL,
    state INTEGER NOT NULL,
    tensors_done INTEGER NOT NULL DEFAULT 0,
    tensors_total INTEGER NOT NULL DEFAULT 0,
    bytes_done INTEGER NOT NULL DEFAULT 0,
    bytes_total INTEGER NOT NULL DEFAULT 0,
    error TEXT NOT NULL DEFAULT '',
    message TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL,
    language_model BLOB NOT NULL DEFAULT x'',
    calibration_report_json TEXT NOT NULL DEFAULT ''
);
-- A repeated request_id of one tenant names the same job (empty ids are not keys).
CREATE UNIQUE INDEX IF NOT EXISTS jobs_request ON jobs (tenant, request_id) WHERE request_id != '';
"""
# Columns added after the table first shipped: a file an older qmill made gets them when opened.
_ADDED_COLUMNS = {
    "language_model": "BLOB NOT NULL DEFAULT x''",
    "calibration_report_json": "TEXT NOT NULL DEFAULT ''",
}


class SqliteJobStore:
    """The jobs table of one SQLite file."""

    shared = False

    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # isolation_level=None: autocommit, each statement is its own transaction.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)
        have = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
        for column, declaration in _ADDED_COLUMNS.items():
            if column not in have:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {declaration}")
        # Jobs whose cancel was asked while they ran; the runner reads it when renewing.
        self._cancels: set[str] = set()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def create(
        self,
        *,
        tenant: str,
        request_id: str,
        source: str,
        destination: str,
        recipe: dict[str, Any],
        output_format: str,
        overwrite: bool,
        language_model: bytes = b"",
    ) -> tuple[JobRecord, bool]:
        """A new QUEUED job, or the existing one with this tenant's request_id (created=False)."""
        now = time.time()
        record = JobRecord(
            job_id=uuid.uuid4().hex,
            tenant=tenant,
            request_id=request_id,
            source=source,
            destination=destination,
            recipe=recipe,
            output_format=output_format,
            overwrite=overwrite,
            language_model=language_model,
            state=pb.JOB_STATE_QUEUED,
            message="queued",
            created=now,
            updated=now,
        )
        with self._lock:
            existing = self._by_request(tenant, request_id)
            if existing is not None:
                return existing, False
            values = dataclasses.asdict(record)
            values["recipe"] = json.dumps(recipe, sort_keys=True)
            self._db.execute(
                f"INSERT INTO jobs ({', '.join(_sql_columns())}) "
                f"VALUES ({', '.join('?' * len(_COLUMNS))})",
                [values[c] for c in _COLUMNS],
            )
        return record, True

    def find(self, tenant: str, request_id: str) -> JobRecord | None:
        """The job of `tenant` submitted with `request_id`, if any (never for an empty id)."""
        with self._lock:
            return self._by_request(tenant, request_id)

    def _by_request(self, tenant: str, request_id: str) -> JobRecord | None:
        if not request_id:
            return None
        row = self._db.execute(
            f"SELECT {', '.join(_sql_columns())} FROM jobs WHERE tenant = ? AND request_id = ?",
            (tenant, request_id),
        ).fetchone()
        return _record(row) if row is not None else None

    def get(self, job_id: str) -> JobRecord | None:
        with self._lock:
            return self._get(job_id)

    def _get(self, job_id: str) -> JobRecord | None:
        row = self._db.execute(
            f"SELECT {', '.join(_sql_columns())} FROM jobs WHERE job_id = ?", (job_id,)
        ).fetchone()
        return _record(row) if row is not None else None

    def list(self, *, tenant: str | None, states: list[int] | None = None) -> list[JobRecord]:
        """Jobs oldest first; of one tenant unless `tenant` is None; in `states` if given."""

        def in_states(s: list[int]) -> tuple[str, list[Any]]:
            return f"state IN ({', '.join('?' * len(s))})", s

        select = ", ".join(_sql_columns())
        query, args = store.list_query(select, "jobs", tenant, states, "?", in_states)
        with self._lock:
            rows = self._db.execute(query, args).fetchall()
        return [_record(r) for r in rows]

    def update(self, job_id: str, *, owner: str | None = None, **fields: Any) -> JobRecord:
        """Sets `fields` (state, progress counters, error, message) and the update time. `owner`
        is not checked: the one runner of this file holds every lease."""
        unknown = set(fields) - set(_COLUMNS)
        if unknown:
            raise KeyError(f"unknown job fields {sorted(unknown)}")
        fields["updated"] = time.time()
        assignments = ", ".join(f"{k} = ?" for k in fields)
        with self._lock:
            self._db.execute(
                f"UPDATE jobs SET {assignments} WHERE job_id = ?", [*fields.values(), job_id]
            )
            if fields.get("state") in store.FINAL:
                self._cancels.discard(job_id)
        record = self.get(job_id)
        assert record is not None
        return record

    def claim(
        self, owner: str, *, lease_seconds: float, tenant_limit: int, take_lapsed: bool = True
    ) -> JobRecord | None:
        """The oldest QUEUED job, now RUNNING. One runner runs one job at a time, so a tenant
        limit of one or more always holds."""
        with self._lock:
            row = self._db.execute(
                "SELECT job_id FROM jobs WHERE state = ? ORDER BY created, job_id LIMIT 1",
                (pb.JOB_STATE_QUEUED,),
            ).fetchone()
        if row is None:
            return None
        return self.update(row[0], state=pb.JOB_STATE_RUNNING, message="running")

    def renew(self, job_id: str, owner: str, *, lease_seconds: float) -> store.Lease:
        with self._lock:
            if job_id in self._cancels:
                return store.Lease.CANCEL
        record = self.get(job_id)
        running = record is not None and record.state == pb.JOB_STATE_RUNNING
        return store.Lease.KEPT if running else store.Lease.LOST

    def release(self, job_id: str, owner: str, message: str) -> None:
        """Nothing to do: no other server could take the job, and this one's next start
        queues it again (recover)."""

    def request_cancel(self, job_id: str) -> tuple[JobRecord, bool]:
        with self._lock:
            record = self._get(job_id)
            assert record is not None
            if record.state == pb.JOB_STATE_RUNNING:
                self._cancels.add(job_id)
        if record.state == pb.JOB_STATE_QUEUED:
            return self.update(job_id, state=pb.JOB_STATE_CANCELLED, message="cancelled"), True
        if record.state == pb.JOB_STATE_RUNNING:
            return self.update(job_id, message="cancelling"), False
        return record, False

    def recover(self) -> None:
        """Jobs RUNNING in the file were this server's when it died: queued again, in order."""
        for record in self.list(tenant=None, states=[pb.JOB_STATE_RUNNING]):
            self.update(record.job_id, state=pb.JOB_STATE_QUEUED, message="resumed after restart")

    def counts(self) -> dict[str, int]:
        """Jobs per state name ("queued", "running", ...), for the qmill_jobs gauge."""
        with self._lock:
            rows = self._db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall()
        return {store.state_name(s): n for s, n in rows}


def _sql_columns() -> list[str]:
    return ["recipe_json" if c == "recipe" else c for c in _COLUMNS]


def _record(row: tuple[Any, ...]) -> JobRecord:
    values = dict(zip(_COLUMNS, row, strict=True))
    values["recipe"] = json.loads(values["recipe"])
    values["overwrite"] = bool(values["overwrite"])
    values["language_model"] = bytes(values["language_model"])
    return JobRecord(**values)
