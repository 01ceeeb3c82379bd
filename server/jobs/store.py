"""Batch jobs kept in SQLite, so they survive a server restart.

One table: a job's request (source, destination, recipe, format, overwrite), its owner tenant
and idempotency key, its state and its progress counters. Per-tensor progress lives beside the
destination, in the partial output the job's run keeps (client/checkpoints/staging.py), which is
what lets a restarted server resume a job without redoing finished tensors.

SQLite is used from the event loop (RPCs) and the runner thread; every call takes one lock and
is short (one row), so neither waits long.
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

# States a job can still leave; QUEUED and RUNNING jobs are resumed when the server starts.
ACTIVE = (pb.JOB_STATE_QUEUED, pb.JOB_STATE_RUNNING)
FINAL = (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)

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
    updated REAL NOT NULL
);
-- A repeated request_id of one tenant names the same job (empty ids are not keys).
CREATE UNIQUE INDEX IF NOT EXISTS jobs_request ON jobs (tenant, request_id) WHERE request_id != '';
"""


@dataclasses.dataclass(frozen=True, kw_only=True)
class JobRecord:
    job_id: str
    # Owner: only this tenant sees the job (admins too, through ListJobs all_tenants).
    tenant: str
    request_id: str
    source: str
    destination: str
    # The recipe as a mapping (client/recipes.py form), JSON in the table.
    recipe: dict[str, Any]
    output_format: str
    overwrite: bool
    state: int
    tensors_done: int = 0
    tensors_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    error: str = ""
    # The last thing that happened, in words (JobEvent.message).
    message: str = ""
    created: float = 0.0
    updated: float = 0.0

    def to_proto(self) -> pb.Job:
        return pb.Job(
            job_id=self.job_id,
            state=self.state,
            source=self.source,
            destination=self.destination,
            request_id=self.request_id,
            tensors_done=self.tensors_done,
            tensors_total=self.tensors_total,
            bytes_done=self.bytes_done,
            bytes_total=self.bytes_total,
            error=self.error,
            message=self.message,
            created_unix=self.created,
            updated_unix=self.updated,
        )


_COLUMNS = [f.name for f in dataclasses.fields(JobRecord)]


class JobStore:
    """The jobs table of one SQLite file."""

    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # isolation_level=None: autocommit, each statement is its own transaction.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

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
            row = self._db.execute(
                f"SELECT {', '.join(_sql_columns())} FROM jobs WHERE job_id = ?", (job_id,)
            ).fetchone()
        return _record(row) if row is not None else None

    def list(self, *, tenant: str | None, states: list[int] | None = None) -> list[JobRecord]:
        """Jobs oldest first; of one tenant unless `tenant` is None; in `states` if given."""
        query = f"SELECT {', '.join(_sql_columns())} FROM jobs WHERE 1 = 1"
        args: list[Any] = []
        if tenant is not None:
            query += " AND tenant = ?"
            args.append(tenant)
        if states:
            query += f" AND state IN ({', '.join('?' * len(states))})"
            args.extend(states)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY created, job_id", args).fetchall()
        return [_record(r) for r in rows]

    def update(self, job_id: str, **fields: Any) -> JobRecord:
        """Sets `fields` (state, progress counters, error, message) and the update time."""
        unknown = set(fields) - set(_COLUMNS)
        if unknown:
            raise KeyError(f"unknown job fields {sorted(unknown)}")
        fields["updated"] = time.time()
        assignments = ", ".join(f"{k} = ?" for k in fields)
        with self._lock:
            self._db.execute(
                f"UPDATE jobs SET {assignments} WHERE job_id = ?", [*fields.values(), job_id]
            )
        record = self.get(job_id)
        assert record is not None
        return record

    def counts(self) -> dict[str, int]:
        """Jobs per state name ("queued", "running", ...), for the qmill_jobs gauge."""
        with self._lock:
            rows = self._db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall()
        return {state_name(s): n for s, n in rows}


def state_name(state: int) -> str:
    return pb.JobState.Name(state).removeprefix("JOB_STATE_").lower()


def _sql_columns() -> list[str]:
    return ["recipe_json" if c == "recipe" else c for c in _COLUMNS]


def _record(row: tuple[Any, ...]) -> JobRecord:
    values = dict(zip(_COLUMNS, row, strict=True))
    values["recipe"] = json.loads(values["recipe"])
    values["overwrite"] = bool(values["overwrite"])
    return JobRecord(**values)
