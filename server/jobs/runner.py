"""Runs batch jobs in a background thread, one at a time, with the CLI's own code.

A job is `qmill quantize` run by the server: the shared checkpoint pipeline
(qmill.checkpoints.pipeline) with the embedded engine as backend, reading the source and writing
the destination from the server's filesystem. Sharing that code with the CLI is what makes a
job's output byte for byte the CLI's, and makes jobs resumable the same way: finished tensors
are kept in `<destination>.qmill-partial/`, so a job that was RUNNING when the server died is
queued again on start and continues where it stopped.

Just before a job starts its paths are checked again against the tenant's directory
(paths.py): a symlink made after the submit must not take the job elsewhere. A job with an
object-store URL runs the same pipeline on local copies in its scratch directory (scratch.py),
deleted when the job ends; a server stopping keeps it for the resumed job.

One job runs at a time: a job already uses every core through JAX, and queued jobs keep their
order. Cancelling stops the job before its next tensor and deletes its partial output; the
destination is never written, because the check runs before the checkpoint is committed. A job
runs in a thread of its own, so a cancel also reaches one stuck where no check runs (a read that
blocks, a long engine call): after CANCEL_GRACE_SECONDS the job is marked cancelled and left to
end on its own -- its thread stops at its next check and writes no state -- and the next job
starts.

A job's tensors are counted under --max-inflight-bytes as a stream's are (room.py), so jobs and
streams together stay within the server's limit.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import pathlib
import queue
import threading
from collections.abc import Callable

from qmill.checkpoints import embedded, errors, formats, pipeline, staging
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import errors as server_errors
from qmill.server import limits
from qmill.server.jobs import paths as paths_lib
from qmill.server.jobs import peers as peers_lib
from qmill.server.jobs import room as room_lib
from qmill.server.jobs import scratch as scratch_lib
from qmill.server.jobs import store as store_lib

log = logging.getLogger(__name__)

# How long a cancelled job gets to stop at its own next check before it is left behind.
CANCEL_GRACE_SECONDS = 2.0


class _Stop(Exception):
    """Raised inside a running job to stop it; `cancelled` tells a cancel from a shutdown."""

    def __init__(self, cancelled: bool) -> None:
        super().__init__("cancelled" if cancelled else "server stopping")
        self.cancelled = cancelled


class _Progress:
    """pipeline.Progress that writes the counters to the store (and so to watchers)."""

    def __init__(self, runner: JobRunner, job_id: str) -> None:
        self._runner, self._job_id = runner, job_id
        self._tensors = self._bytes = 0
        self._total = 0

    def start(self, total_bytes: int, total_tensors: int) -> None:
        self._total = total_tensors
        self._runner._update(
            self._job_id,
            tensors_total=total_tensors,
            bytes_total=total_bytes,
            tensors_done=0,
            bytes_done=0,
        )

    def advance(self, nbytes: int) -> None:
        self._tensors += 1
        self._bytes += nbytes
        self._runner._update(
            self._job_id,
            tensors_done=self._tensors,
            bytes_done=self._bytes,
            message=f"tensor {self._tensors}/{self._total} done",
        )


class JobRunner:
    """The background thread that runs queued jobs in order."""

    def __init__(
        self,
        store: store_lib.JobStore,
        *,
        paths: paths_lib.PathPolicy,
        on_change: Callable[[], None] | None = None,
        new_backend: Callable[[], pipeline.Backend] = embedded.EmbeddedClient,
        scratch: scratch_lib.Scratch | None = None,
        max_tensor_bytes: int | None = None,
        limiter: limits.ByteLimiter | None = None,
    ) -> None:
        self.store = store
        # The server's in-flight limiter; bridged to the job thread once the loop is known.
        self._limiter = limiter
        self._room: room_lib.Room | None = None
        # A job's tensors obey --max-tensor-bytes as streamed ones do: a small sparse file that
        # declares a 2 GiB tensor must not make the server allocate it.
        self._max_tensor_bytes = max_tensor_bytes
        # Makes each job's backend: the in-process engine, or a FanoutClient over the replicas
        # of --job-peers (peers.py).
        self._new_backend = new_backend
        # Where jobs may read and write; SubmitJob checks with the same policy.
        self.paths = paths
        # Local copies for jobs with object-store URLs (scratch.py), in the server's data dir.
        self.scratch = scratch or scratch_lib.Scratch.in_data_dir(None)
        # Called after every change of a job (the server updates the qmill_jobs gauge).
        self._on_change = on_change
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._lock = threading.Lock()
        self._current: str | None = None
        # The running job's own cancel flag: a job left behind keeps its set flag.
        self._cancel = threading.Event()
        # Jobs left behind by a cancel: their threads may still run but change no state.
        self._abandoned: set[str] = set()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="qmill-jobs", daemon=True)

    def start(self) -> None:
        """Queues the jobs a previous server left QUEUED or RUNNING, then starts the thread.

        Called on the server's event loop, whose limiter the jobs then reserve under."""
        if self._limiter is not None:
            try:
                self._room = room_lib.Room(self._limiter, asyncio.get_running_loop())
            except RuntimeError:  # started outside an event loop (unit tests): no limiter
                self._room = None
        for record in self.store.list(tenant=None, states=list(store_lib.ACTIVE)):
            if record.state == pb.JOB_STATE_RUNNING:
                self._update(
                    record.job_id, state=pb.JOB_STATE_QUEUED, message="resumed after restart"
                )
            self._queue.put(record.job_id)
        self._notify()
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops after the current tensor; the running job stays RUNNING, resumed next start."""
        self._stopping.set()
        self._queue.put(None)
        self._thread.join(timeout)

    def submit(self, job_id: str) -> None:
        self._queue.put(job_id)

    def cancel(self, job_id: str) -> store_lib.JobRecord:
        """Cancels a queued job now; a running one stops at its next check, or is left behind
        after CANCEL_GRACE_SECONDS wherever it is stuck."""
        with self._lock:
            record = self.store.get(job_id)
            assert record is not None
            if record.state in store_lib.FINAL:
                return record
            if self._current == job_id:
                self._cancel.set()
                return self._update(job_id, message="cancelling")
            return self._finish(job_id, pb.JOB_STATE_CANCELLED, "cancelled")

    def _loop(self) -> None:
        while not self._stopping.is_set():
            job_id = self._queue.get()
            if job_id is None:
                return
            with self._lock:
                record = self.store.get(job_id)
                if record is None or record.state != pb.JOB_STATE_QUEUED:
                    continue  # cancelled while queued
                self._current = job_id
                self._cancel = threading.Event()
                self._update(job_id, state=pb.JOB_STATE_RUNNING, message="running")
            try:
                self._supervise(record, self._cancel)
            finally:
                with self._lock:
                    self._current = None

    def _supervise(self, record: store_lib.JobRecord, cancel: threading.Event) -> None:
        """Runs the job in a thread of its own; leaves it behind when a cancel cannot reach it
        within CANCEL_GRACE_SECONDS. (A stopping server waits for it as before: stop() joins
        this thread with a timeout, and a job still RUNNING is resumed by the next server.)"""
        done = threading.Event()
        where: dict[str, str] = {}  # the job's resolved destination, once known

        def run() -> None:
            try:
                self._run(record, functools.partial(self._check, cancel), where)
            finally:
                done.set()

        name = f"qmill-job-{record.job_id[:8]}"
        threading.Thread(target=run, name=name, daemon=True).start()
        while not done.wait(0.1):
            if cancel.is_set() and not done.wait(CANCEL_GRACE_SECONDS):
                break
        else:
            return
        with self._lock:
            if done.is_set():
                return  # it ended by itself just now
            self._abandoned.add(record.job_id)
            log.warning("job %s cancelled while stuck (e.g. a blocked read); left behind", name)
            if "destination" in where:
                self._remove_partial(where["destination"])
            self._finish(record.job_id, pb.JOB_STATE_CANCELLED, "cancelled", force=True)

    def _check(self, cancel: threading.Event) -> None:
        if cancel.is_set():
            raise _Stop(cancelled=True)
        if self._stopping.is_set():
            raise _Stop(cancelled=False)

    def _reserving(
        self, backend: pipeline.Backend, record: store_lib.JobRecord, source: str, check
    ) -> pipeline.Backend:
        """`backend` with its tensors counted under the server's in-flight limit."""
        if self._room is None:
            return backend
        with formats.open_source(source) as opened:
            sizes = [e.nbytes for e in opened.entries() if e.dtype.name in pipeline.QUANTIZABLE]
        return room_lib.ReservingBackend(
            backend, self._room, tenant=record.tenant, largest=max(sizes, default=0), check=check
        )

    def _run(
        self, record: store_lib.JobRecord, check: Callable[[], None], where: dict[str, str]
    ) -> None:
        destination = record.destination
        try:
            source, destination = self.paths.check_job(
                record.tenant, record.source, record.destination
            )
            # Object-store URLs: the source is downloaded, the output written locally and
            # uploaded once complete (scratch.py); local paths pass through unchanged.
            staged = self.scratch.stage(
                record.job_id, source, destination, overwrite=record.overwrite, check=check
            )
            source, destination = staged.source, staged.destination
            where["destination"] = destination
            with self._new_backend() as backend:
                pipeline.quantize_checkpoint(
                    source,
                    destination,
                    record.recipe,
                    backend=self._reserving(backend, record, source, check),
                    output_format=record.output_format or None,
                    overwrite=staged.overwrite,
                    progress=_Progress(self, record.job_id),
                    check=check,
                    max_tensor_bytes=self._max_tensor_bytes,
                )
                spread = peers_lib.describe_spread(backend)
            staged.publish(overwrite=record.overwrite, check=check)
        except _Stop as stop:
            if stop.cancelled:
                self._remove_partial(destination)
                self._finish(record.job_id, pb.JOB_STATE_CANCELLED, "cancelled")
            return  # stopping: left RUNNING, resumed by the next server
        except errors.OutputError as e:
            # A full or read-only disk: the message says so, the error what is kept to resume.
            message = f"failed: could not write the output ({e.code})"
            self._finish(record.job_id, pb.JOB_STATE_FAILED, message, error=e.details)
        except errors.QmillError as e:
            self._finish(record.job_id, pb.JOB_STATE_FAILED, "failed", error=e.details)
        except (server_errors.ServerError, ValueError, TypeError, OSError, RuntimeError) as e:
            self._finish(record.job_id, pb.JOB_STATE_FAILED, "failed", error=str(e))
        except Exception:
            log.exception("job %s failed", record.job_id)
            self._finish(record.job_id, pb.JOB_STATE_FAILED, "failed", error="internal error")
        else:
            self._finish(
                record.job_id, pb.JOB_STATE_SUCCEEDED, f"wrote {record.destination}{spread}"
            )

    @staticmethod
    def _remove_partial(destination: str) -> None:
        path = pathlib.Path(destination).absolute()
        staging.remove(path.with_name(path.name + staging.PARTIAL_SUFFIX))

    def _finish(
        self, job_id: str, state: int, message: str, *, error: str = "", force: bool = False
    ) -> store_lib.JobRecord:
        if job_id in self._abandoned and not force:
            return self.store.get(job_id)  # a job left behind: its state is already final
        log.info("job %s %s%s", job_id, store_lib.state_name(state), f": {error}" if error else "")
        # Before the state changes: whoever sees the job ended sees its scratch gone.
        self.scratch.discard(job_id)
        return self._update(job_id, state=state, message=message, error=error, force=force)

    def _update(self, job_id: str, *, force: bool = False, **fields: object) -> store_lib.JobRecord:
        if job_id in self._abandoned and not force:
            return self.store.get(job_id)  # progress of a job left behind is not reported
        record = self.store.update(job_id, **fields)
        if "state" in fields:
            self._notify()
        return record

    def _notify(self) -> None:
        if self._on_change is not None:
            self._on_change()
