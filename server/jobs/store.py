"""What a job store keeps, and the interface the runner and the Jobs service use.

Two stores implement it: SQLite (sqlite_store.py), the default, for one server whose jobs live
in one file of its data dir; PostgreSQL (postgres_store.py, `--jobs-db postgresql://...`), for a
fleet of replicas sharing one queue. Every replica answers Submit / Get / Watch / List / Cancel
for every job; runners claim queued jobs and hold a lease on the job they run, renewing it while
it runs; a job whose lease lapsed (its runner's pod was killed) is claimed again by another
replica, which resumes it from its partial output.

Per-tensor progress is not in the store: it lives beside the destination, in the partial output
the job's run keeps (checkpoints/base/staging.py), which is what lets a job resume without redoing
finished tensors.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, Protocol

from qmill.proto.v1 import qmill_pb2 as pb

# States a job can still leave; QUEUED and RUNNING jobs are resumed when the server starts.
ACTIVE = (pb.JOB_STATE_QUEUED, pb.JOB_STATE_RUNNING)
FINAL = (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)


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
    # A language-model job's calibration: the serialized pb.LanguageModelCalibration of its
    # SubmitJobRequest (b"" for other jobs), kept so a resumed job calibrates the same way.
    language_model: bytes = b""
    # What a language-model job's calibration reported (Job.calibration_report_json), once done.
    calibration_report_json: str = ""

    def to_proto(self) -> pb.Job:
        same = {name: getattr(self, name) for name in _JOB_FIELDS}
        return pb.Job(**same, created_unix=self.created, updated_unix=self.updated)


# The fields a JobRecord and a pb.Job share by name (what a client sees of a job).
_JOB_FIELDS = (
    "job_id", "state", "source", "destination", "request_id", "tensors_done", "tensors_total",
    "bytes_done", "bytes_total", "error", "message", "calibration_report_json",
)  # fmt: skip


COLUMNS = [f.name for f in dataclasses.fields(JobRecord)]


def list_query(
    select: str,
    table: str,
    tenant: str | None,
    states: list[int] | None,
    param: str,
    in_states: Callable[[list[int]], tuple[str, list[Any]]],
) -> tuple[str, list[Any]]:
    """(query, arguments) that select `select` of the jobs in `table` oldest first, of one
    tenant unless `tenant` is None, in `states` if given; `param` is the driver's placeholder and
    `in_states` the condition (and its arguments) for a list of states."""
    query, args = f"SELECT {select} FROM {table} WHERE 1 = 1", []
    if tenant is not None:
        query += f" AND tenant = {param}"
        args.append(tenant)
    if states:
        condition, more = in_states(list(states))
        query += f" AND {condition}"
        args.extend(more)
    return query + " ORDER BY created, job_id", args


class Lease(enum.Enum):
    """What renewing a running job's lease found."""

    KEPT = "kept"
    # Someone asked to cancel the job (CancelJob on any replica): the runner stops it.
    CANCEL = "cancel"
    # The job is no longer this runner's (its lease lapsed and another replica claimed it, or
    # it ended): the runner stops it and writes nothing more about it.
    LOST = "lost"


class JobStore(Protocol):
    """The operations on jobs. Each is one short transaction; a store that cannot reach its
    database raises errors.Unavailable (the client is told to retry)."""

    # Whether other servers share these jobs (a job's partial output must then be where any
    # replica finds it: scratch.py mirrors it to the object store).
    shared: bool

    def create(self, **fields: Any) -> tuple[JobRecord, bool]:
        """A new QUEUED job (fields: tenant, request_id, source, destination, recipe,
        output_format, overwrite; language_model for a calibrated language model), or the
        tenant's job of that request_id (created=False)."""
        ...

    def find(self, tenant: str, request_id: str) -> JobRecord | None: ...
    def get(self, job_id: str) -> JobRecord | None: ...
    def list(self, *, tenant: str | None, states: list[int] | None = None) -> list[JobRecord]: ...

    def update(self, job_id: str, *, owner: str | None = None, **fields: Any) -> JobRecord | None:
        """Sets `fields` and the update time; with `owner`, only while that runner holds the
        job's lease (None: it does not, nothing was written)."""
        ...

    def counts(self) -> dict[str, int]: ...

    def claim(
        self, owner: str, *, lease_seconds: float, tenant_limit: int, take_lapsed: bool = True
    ) -> JobRecord | None:
        """The oldest job this runner may start, now RUNNING under its lease: a QUEUED job, or
        (with `take_lapsed`) a RUNNING one whose lease lapsed; never one whose tenant already
        runs `tenant_limit` jobs (0: no limit). None when there is none."""
        ...

    def renew(self, job_id: str, owner: str, *, lease_seconds: float) -> Lease: ...

    def release(self, job_id: str, owner: str, message: str) -> None:
        """Hands a running job back (QUEUED, no lease) for any runner to claim and resume."""
        ...

    def request_cancel(self, job_id: str) -> tuple[JobRecord, bool]:
        """A QUEUED job is CANCELLED now (True: this call cancelled it); a RUNNING one is marked
        for its runner, which stops it at its next lease renewal. Final jobs are left as they
        are."""
        ...

    def recover(self) -> None:
        """Called once when the server starts, before its runner claims anything."""
        ...

    def close(self) -> None: ...


def state_name(state: int) -> str:
    return pb.JobState.Name(state).removeprefix("JOB_STATE_").lower()


def is_database_url(value: str | None) -> bool:
    """Whether --jobs-db names a PostgreSQL database rather than a SQLite file."""
    return bool(value) and value.startswith(("postgresql://", "postgres://"))
