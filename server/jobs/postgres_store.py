"""Batch jobs in PostgreSQL: one queue shared by every replica (`--jobs-db postgresql://...`).

The table is store.JobRecord's columns plus the lease: `owner` (the runner that claimed the
job, one id per server process), `lease_until` (the database's clock, so replicas' clocks need
not agree), `cancel_requested` (CancelJob on any replica sets it; the runner reads it when it
renews) and `claims` (how often the job was claimed: more than once means it was resumed).

Claiming takes the oldest claimable rows with FOR UPDATE SKIP LOCKED, so replicas claiming at
once never wait on each other nor take the same job. A tenant's limit of running jobs is checked
under a transaction-scoped advisory lock on the tenant: two replicas cannot both see "one slot
left" for the same tenant. The schema is created and migrated on start, under an advisory lock,
so replicas starting together migrate once.

psycopg 3 (the optional `postgres` extra) is imported on use: a server with SQLite jobs does not
need it. One connection per store, used under a lock (each call is one short statement or
transaction); a connection the database dropped (a restart, a failover) is opened again by the
next call, and the call that found it broken raises errors.Unavailable: the client retries, and
the runner keeps its job going (runner.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import errors
from qmill.server.jobs import store
from qmill.server.jobs.store import COLUMNS, JobRecord

log = logging.getLogger(__name__)

EXTRA = "postgres"
TABLE = "qmill_jobs"
# Advisory lock keys (first half of a two-int key): schema migrations, one tenant's claims.
_MIGRATION_LOCK = 7_301_001
_TENANT_LOCK = 7_301_002
# Rows looked at per claim: enough to step over the queued jobs of tenants at their limit.
_CLAIM_WINDOW = 64
# Seconds to wait for a connection before the call fails (a database that is down).
CONNECT_TIMEOUT = 5

_QUEUED, _RUNNING = pb.JOB_STATE_QUEUED, pb.JOB_STATE_RUNNING

# Migration N brings the schema from version N-1 to N; never edit one that has shipped.
MIGRATIONS = [
    f"""
    CREATE TABLE {TABLE} (
        job_id TEXT PRIMARY KEY,
        tenant TEXT NOT NULL,
        request_id TEXT NOT NULL,
        source TEXT NOT NULL,
        destination TEXT NOT NULL,
        recipe_json TEXT NOT NULL,
        output_format TEXT NOT NULL,
        overwrite BOOLEAN NOT NULL,
        state INTEGER NOT NULL,
        tensors_done BIGINT NOT NULL DEFAULT 0,
        tensors_total BIGINT NOT NULL DEFAULT 0,
        bytes_done BIGINT NOT NULL DEFAULT 0,
        bytes_total BIGINT NOT NULL DEFAULT 0,
        error TEXT NOT NULL DEFAULT '',
        message TEXT NOT NULL DEFAULT '',
        created DOUBLE PRECISION NOT NULL,
        updated DOUBLE PRECISION NOT NULL,
        owner TEXT,
        lease_until TIMESTAMPTZ,
        cancel_requested BOOLEAN NOT NULL DEFAULT FALSE,
        claims INTEGER NOT NULL DEFAULT 0
    );
    -- A repeated request_id of one tenant names the same job (empty ids are not keys).
    CREATE UNIQUE INDEX {TABLE}_request ON {TABLE} (tenant, request_id) WHERE request_id <> '';
    CREATE INDEX {TABLE}_active ON {TABLE} (created, job_id) WHERE state IN ({_QUEUED}, {_RUNNING});
    """,
    # 2: a language-model job's calibration request and, once done, its report.
    f"""
    ALTER TABLE {TABLE} ADD COLUMN language_model BYTEA NOT NULL DEFAULT ''::bytea;
    ALTER TABLE {TABLE} ADD COLUMN calibration_report_json TEXT NOT NULL DEFAULT '';
    """,
]

_SELECT = ", ".join("recipe_json" if c == "recipe" else c for c in COLUMNS)
# A lease counts while it has not lapsed.
_LIVE = "lease_until >= now()"

T = TypeVar("T")


class PostgresJobStore:
    """The qmill_jobs table of one PostgreSQL database."""

    shared = True

    def __init__(self, url: str) -> None:
        try:
            import psycopg
        except ImportError as e:
            raise errors.FailedPrecondition(
                f"--jobs-db names a PostgreSQL database but the psycopg package is not "
                f"installed; install the {EXTRA} extra (pip install 'qmill[{EXTRA}]')"
            ) from e
        self._psycopg = psycopg
        self._url = url
        self._lock = threading.Lock()
        self._conn: Any = None
        self._run(_migrate)

    # --- connection ---------------------------------------------------------------------------

    def _run(self, fn: Callable[[Any], T]) -> T:
        """fn(connection), under the lock; a lost connection becomes errors.Unavailable."""
        pg = self._psycopg
        with self._lock:
            try:
                if self._conn is None or self._conn.closed or self._conn.broken:
                    self._conn = pg.connect(
                        self._url, autocommit=True, connect_timeout=CONNECT_TIMEOUT
                    )
                return fn(self._conn)
            except (pg.OperationalError, pg.InterfaceError) as e:
                self._drop()
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise errors.Unavailable(
                    f"the job database is unreachable ({reason}); retry"
                ) from e

    def _drop(self) -> None:
        if self._conn is not None:
            # Closing a broken connection may fail too.
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn = None

    def close(self) -> None:
        with self._lock:
            self._drop()

    # --- jobs ---------------------------------------------------------------------------------

    def create(self, **fields: Any) -> tuple[JobRecord, bool]:
        now = time.time()
        record = JobRecord(
            job_id=uuid.uuid4().hex,
            state=_QUEUED,
            message="queued",
            created=now,
            updated=now,
            **fields,
        )
        values = dataclasses.asdict(record)
        values["recipe"] = json.dumps(record.recipe, sort_keys=True)
        row = self._run(
            lambda c: c.execute(
                f"INSERT INTO {TABLE} ({_SELECT}) VALUES ({', '.join(['%s'] * len(COLUMNS))}) "
                "ON CONFLICT (tenant, request_id) WHERE request_id <> '' DO NOTHING "
                "RETURNING job_id",
                [values[c] for c in COLUMNS],
            ).fetchone()
        )
        if row is not None:
            return record, True
        existing = self.find(record.tenant, record.request_id)
        assert existing is not None  # a conflict is on (tenant, request_id), which is kept
        return existing, False

    def find(self, tenant: str, request_id: str) -> JobRecord | None:
        if not request_id:
            return None
        return self._one("tenant = %s AND request_id = %s", (tenant, request_id))

    def get(self, job_id: str) -> JobRecord | None:
        return self._one("job_id = %s", (job_id,))

    def _one(self, where: str, args: tuple[Any, ...]) -> JobRecord | None:
        query = f"SELECT {_SELECT} FROM {TABLE} WHERE {where}"
        row = self._run(lambda c: c.execute(query, args).fetchone())
        return _record(row) if row is not None else None

    def list(self, *, tenant: str | None, states: list[int] | None = None) -> list[JobRecord]:
        query, args = store.list_query(
            _SELECT, TABLE, tenant, states, "%s", lambda s: ("state = ANY(%s)", [s])
        )
        rows = self._run(lambda c: c.execute(query, args).fetchall())
        return [_record(r) for r in rows]

    def update(self, job_id: str, *, owner: str | None = None, **fields: Any) -> JobRecord | None:
        unknown = set(fields) - set(COLUMNS)
        if unknown:
            raise KeyError(f"unknown job fields {sorted(unknown)}")
        fields["updated"] = time.time()
        assignments = [f"{k} = %s" for k in fields]
        if fields.get("state") in store.FINAL:
            assignments.append("lease_until = NULL")
        query = f"UPDATE {TABLE} SET {', '.join(assignments)} WHERE job_id = %s"
        args = [*fields.values(), job_id]
        if owner is not None:
            query += f" AND owner = %s AND state = {_RUNNING}"
            args.append(owner)
        row = self._run(lambda c: c.execute(f"{query} RETURNING {_SELECT}", args).fetchone())
        return _record(row) if row is not None else None

    def counts(self) -> dict[str, int]:
        query = f"SELECT state, COUNT(*) FROM {TABLE} GROUP BY state"
        rows = self._run(lambda c: c.execute(query).fetchall())
        return {store.state_name(s): n for s, n in rows}

    # --- leases -------------------------------------------------------------------------------

    def claim(
        self, owner: str, *, lease_seconds: float, tenant_limit: int, take_lapsed: bool = True
    ) -> JobRecord | None:
        return self._run(lambda c: _claim(c, owner, lease_seconds, tenant_limit, take_lapsed))

    def renew(self, job_id: str, owner: str, *, lease_seconds: float) -> store.Lease:
        query = (
            f"UPDATE {TABLE} SET lease_until = now() + make_interval(secs => %s) "
            f"WHERE job_id = %s AND owner = %s AND state = {_RUNNING} RETURNING cancel_requested"
        )
        row = self._run(lambda c: c.execute(query, (lease_seconds, job_id, owner)).fetchone())
        if row is None:
            return store.Lease.LOST
        return store.Lease.CANCEL if row[0] else store.Lease.KEPT

    def release(self, job_id: str, owner: str, message: str) -> None:
        query = (
            f"UPDATE {TABLE} SET state = {_QUEUED}, owner = NULL, lease_until = NULL, "
            f"message = %s, updated = %s WHERE job_id = %s AND owner = %s AND state = {_RUNNING}"
        )
        self._run(lambda c: c.execute(query, (message, time.time(), job_id, owner)))

    def request_cancel(self, job_id: str) -> tuple[JobRecord, bool]:
        # One statement: a job claimed or handed back meanwhile is seen in its new state.
        query = (
            f"UPDATE {TABLE} SET "
            f"message = CASE WHEN state = {_QUEUED} THEN 'cancelled' ELSE 'cancelling' END, "
            f"cancel_requested = (state = {_RUNNING}), "
            f"state = CASE WHEN state = {_QUEUED} THEN {pb.JOB_STATE_CANCELLED} ELSE state END, "
            f"updated = %s WHERE job_id = %s AND state IN ({_QUEUED}, {_RUNNING}) "
            f"RETURNING {_SELECT}"
        )
        row = self._run(lambda c: c.execute(query, (time.time(), job_id)).fetchone())
        if row is None:
            record = self.get(job_id)
            assert record is not None
            return record, False
        record = _record(row)
        return record, record.state == pb.JOB_STATE_CANCELLED

    def recover(self) -> None:
        """Nothing to do: a job whose runner died is claimed again once its lease lapses."""


def _migrate(conn: Any) -> None:
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s, 0)", (_MIGRATION_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS qmill_schema (version INTEGER NOT NULL)")
        row = conn.execute("SELECT max(version) FROM qmill_schema").fetchone()
        version = row[0] or 0
        if version > len(MIGRATIONS):
            raise errors.FailedPrecondition(
                f"the job database's schema is version {version}, newer than this qmill knows "
                f"({len(MIGRATIONS)}); run the newer qmill"
            )
        for number in range(version + 1, len(MIGRATIONS) + 1):
            conn.execute(MIGRATIONS[number - 1])
            conn.execute("INSERT INTO qmill_schema (version) VALUES (%s)", (number,))
            log.info("jobs: database schema migrated to version %d", number)


def _claim(
    conn: Any, owner: str, lease_seconds: float, tenant_limit: int, take_lapsed: bool
) -> JobRecord | None:
    claimable = f"state = {_QUEUED}"
    if take_lapsed:
        claimable += f" OR (state = {_RUNNING} AND (lease_until IS NULL OR NOT {_LIVE}))"
    with conn.transaction():
        candidates = conn.execute(
            f"SELECT job_id, tenant FROM {TABLE} WHERE {claimable} "
            "ORDER BY created, job_id "
            f"LIMIT {_CLAIM_WINDOW} FOR UPDATE SKIP LOCKED"
        ).fetchall()
        for job_id, tenant in candidates:
            if tenant_limit and not _tenant_has_room(conn, job_id, tenant, tenant_limit):
                continue
            row = conn.execute(
                f"UPDATE {TABLE} SET state = {_RUNNING}, owner = %s, "
                "lease_until = now() + make_interval(secs => %s), claims = claims + 1, "
                "message = CASE WHEN claims > 0 THEN 'resumed by another runner' "
                "ELSE 'running' END, updated = %s "
                f"WHERE job_id = %s RETURNING {_SELECT}",
                (owner, lease_seconds, time.time(), job_id),
            ).fetchone()
            return _record(row)
    return None


def _tenant_has_room(conn: Any, job_id: str, tenant: str, limit: int) -> bool:
    """Whether `tenant` runs fewer than `limit` jobs besides `job_id`. The advisory lock (held
    to the end of the claim's transaction) makes a concurrent claim for the tenant skip it."""
    locked = conn.execute(
        "SELECT pg_try_advisory_xact_lock(%s, hashtext(%s))", (_TENANT_LOCK, tenant)
    ).fetchone()[0]
    if not locked:
        return False
    running = conn.execute(
        f"SELECT COUNT(*) FROM {TABLE} WHERE tenant = %s AND state = {_RUNNING} AND {_LIVE} "
        "AND job_id <> %s",
        (tenant, job_id),
    ).fetchone()[0]
    return running < limit


def _record(row: tuple[Any, ...]) -> JobRecord:
    values = dict(zip(COLUMNS, row, strict=True))
    values["recipe"] = json.loads(values["recipe"])
    values["language_model"] = bytes(values["language_model"])
    return JobRecord(**values)
