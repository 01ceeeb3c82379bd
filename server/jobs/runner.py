"""Runs batch jobs in a background thread, one at a time, with the CLI's own code.

A job is `qmill quantize` run by the server: the shared checkpoint pipeline
(qmill.checkpoints.pipeline) with the embedded engine as backend, reading the source and writing
the destination from the server's filesystem. Sharing that code with the CLI is what makes a
job's output byte for byte the CLI's, and makes jobs resumable the same way: finished tensors
are kept in `<destination>.qmill-partial/`, so a job that was RUNNING when the server died is
queued again on start and continues where it stopped.

The runner claims its next job from the store and holds a lease on it, renewed every
RENEW_SECONDS or so while the job runs (store.py). With a shared store (PostgreSQL) several
replicas' runners take jobs from one queue: a runner that stops renewing (its pod killed) loses
the job to another replica once the lease lapses, which resumes it from the partial output (for
an object-store destination, the copy mirror.py keeps beside it); a runner whose renewal finds
its lease gone stops the job and writes nothing more about it. A cancel asked on any replica
reaches the runner with its next renewal. A stopping (draining) server stops claiming and hands
its running job back, queued, for another runner to resume.

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

A language-model job (SubmitJobRequest.language_model) first calibrates its Hugging Face folder
layer by layer (language_model.py: the CLI's lm_calibration, progress as the job's message), then
runs the same pipeline with the calibrated results; its kept layers resume it the same way.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import pathlib
import socket
import threading
import time
import uuid
from collections.abc import Callable

from qmill.checkpoints.base import errors, staging
from qmill.checkpoints.lm import calibration as lm_calibration
from qmill.checkpoints.run import embedded, pipeline
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import errors as server_errors
from qmill.server import limits
from qmill.server.jobs import language_model as lm_jobs
from qmill.server.jobs import mirror as mirror_lib
from qmill.server.jobs import outage as outage_lib
from qmill.server.jobs import paths as paths_lib
from qmill.server.jobs import peers as peers_lib
from qmill.server.jobs import progress as progress_lib
from qmill.server.jobs import room as room_lib
from qmill.server.jobs import scratch as scratch_lib
from qmill.server.jobs import store as store_lib

log = logging.getLogger(__name__)

# How long a cancelled job gets to stop at its own next check before it is left behind.
CANCEL_GRACE_SECONDS = 2.0
# Longest time between two lease renewals (shorter for short leases: a third of the lease). A
# cancel asked on another replica reaches the runner with a renewal.
RENEW_SECONDS = 2.0
# How often an idle runner looks for a job it may claim (a submit on this server wakes it at
# once; jobs submitted to other replicas, and lapsed leases, are found by looking).
POLL_SECONDS = 1.0


class _Stop(Exception):
    """Raised inside a running job to stop it: cancelled, the server stopping, or the lease lost
    (another runner has the job now)."""

    def __init__(self, cancelled: bool, lost: bool = False) -> None:
        super().__init__("cancelled" if cancelled else "lease lost" if lost else "stopping")
        self.cancelled = cancelled
        self.lost = lost


class JobRunner:
    """The background thread that claims jobs from the store and runs them, one at a time."""

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
        lease_seconds: float = 30.0,
        tenant_limit: int = 0,
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
        # This runner's name in the leases it holds: the pod's (host's) name, the process, and
        # a random part, so a restarted process never mistakes an old lease for its own.
        self.owner = f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        self._lease_seconds = lease_seconds
        self._renew_seconds = min(RENEW_SECONDS, lease_seconds / 3)
        # Running jobs per tenant, all replicas together (0: no limit).
        self._tenant_limit = tenant_limit
        self._wake = threading.Event()
        # Reentrant: a job left behind is finished (_finish → _update) while it is held.
        self._lock = threading.RLock()
        self._current: str | None = None
        # The running job's own cancel flag: a job left behind keeps its set flag.
        self._cancel = threading.Event()
        # Jobs left behind by a cancel: their threads may still run but change no state.
        self._abandoned: set[str] = set()
        self._stopping = threading.Event()
        # The job database away (a restart, a failover): logged once, progress held meanwhile.
        self._outage = outage_lib.Outage()
        # Per job, the latest progress fields not yet written (the database was away): written
        # with the next progress update that reaches it, or with the job's final state.
        self._unwritten: dict[str, dict[str, object]] = {}
        self._thread = threading.Thread(target=self._loop, name="qmill-jobs", daemon=True)

    def start(self) -> None:
        """Recovers the jobs a previous server left (store.recover), then starts the thread.

        Called on the server's event loop, whose limiter the jobs then reserve under."""
        if self._limiter is not None:
            try:
                self._room = room_lib.Room(self._limiter, asyncio.get_running_loop())
            except RuntimeError:  # started outside an event loop (unit tests): no limiter
                self._room = None
        self.store.recover()
        self._notify()
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops claiming; the running job stops after its current tensor and is handed back
        (queued again) for this server's next start, or another replica, to resume."""
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)

    def submit(self, job_id: str) -> None:
        self._wake.set()

    def cancel(self, job_id: str) -> store_lib.JobRecord:
        """Cancels a queued job now; a running one stops at its next check (its runner, on any
        replica, learns of it when it renews its lease), or is left behind after
        CANCEL_GRACE_SECONDS wherever it is stuck."""
        record, cancelled_now = self.store.request_cancel(job_id)
        if cancelled_now:
            log.info("job %s cancelled while queued", job_id)
            self.scratch.discard(job_id)
            if self.store.shared:  # a job handed back may have left its partial output there
                mirror_lib.remove(record.destination, job_id)
            self._notify()
        with self._lock:
            if self._current == job_id:
                self._cancel.set()
        return record

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                record = self.store.claim(
                    self.owner,
                    lease_seconds=self._lease_seconds,
                    tenant_limit=self._tenant_limit,
                    # After an outage every lease may have lapsed meanwhile: their runners get a
                    # lease's time to renew them (and write the end of a job that ended while
                    # the database was away) before this one takes their jobs.
                    take_lapsed=self._outage.answered_for(self._lease_seconds),
                )
            except server_errors.Unavailable as e:
                self._outage.failed(e, held=False)  # logged once per outage
                record = None
            else:
                self._outage.answered()
            if record is None:
                self._wake.wait(POLL_SECONDS)
                continue
            log.info("job %s claimed by %s (%s)", record.job_id, self.owner, record.message)
            with self._lock:
                self._current = record.job_id
                self._cancel = threading.Event()
            self._notify()
            try:
                self._supervise(record, self._cancel)
            finally:
                with self._lock:
                    self._current = None

    def _supervise(self, record: store_lib.JobRecord, cancel: threading.Event) -> None:
        """Runs the job in a thread of its own, renewing its lease; leaves it behind when a
        cancel cannot reach it within CANCEL_GRACE_SECONDS. (A stopping server waits for it as
        before: stop() joins this thread with a timeout, and a job still RUNNING is resumed by
        the next server, or another replica once its lease lapses.)"""
        done, lost = threading.Event(), threading.Event()
        where: dict[str, str] = {}  # the job's resolved destination, once known

        def run() -> None:
            try:
                self._run(record, functools.partial(self._check, cancel, lost), where)
            finally:
                done.set()

        name = f"qmill-job-{record.job_id[:8]}"
        threading.Thread(target=run, name=name, daemon=True).start()
        renew_at = 0.0  # at once: a cancel asked before the claim stops the job before it starts
        while not done.wait(0.1):
            if time.monotonic() >= renew_at:
                self._renew(record.job_id, cancel, lost)
                renew_at = time.monotonic() + self._renew_seconds
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
            self._finish(record, pb.JOB_STATE_CANCELLED, "cancelled", force=True)

    def _renew(self, job_id: str, cancel: threading.Event, lost: threading.Event) -> None:
        try:
            lease = self.store.renew(job_id, self.owner, lease_seconds=self._lease_seconds)
        except server_errors.Unavailable as e:
            # The job goes on: if the database is back before the lease lapses, nothing was
            # lost; if not, the next renewal finds the job taken and stops it. Logged once per
            # outage; renewals are not held back, they find the database back soonest.
            self._outage.failed(e, held=False)
            return
        self._outage.answered()
        if lease is store_lib.Lease.CANCEL:
            cancel.set()
        elif lease is store_lib.Lease.LOST and not lost.is_set():
            log.warning("job %s: lease lost (another runner has it); stopping here", job_id)
            lost.set()

    def _check(self, cancel: threading.Event, lost: threading.Event) -> None:
        if lost.is_set():
            raise _Stop(cancelled=False, lost=True)
        if cancel.is_set():
            raise _Stop(cancelled=True)
        if self._stopping.is_set():
            raise _Stop(cancelled=False)

    def _run(
        self, record: store_lib.JobRecord, check: Callable[[], None], where: dict[str, str]
    ) -> None:
        destination = record.destination
        mirror = None
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
            mirror = self._mirror(record, staged)
            calibrated = untie = None
            if record.language_model:
                # A Hugging Face causal LM calibrated layer by layer first (language_model.py).
                lm = lm_jobs.LmJob.decode(record.language_model)
                update = functools.partial(self._update, record.job_id)
                calibrated = lm_jobs.calibrate(
                    lm, source, destination, record.recipe, check=check, update=update
                )
                untie = lm_jobs.untie(lm, source)  # --method hadamard: a tied head, untied
            new_backend = self._new_backend
            if calibrated is not None:
                new_backend = functools.partial(lm_jobs.backend, calibrated)
            with new_backend() as backend:
                pipeline.quantize_checkpoint(
                    source,
                    destination,
                    record.recipe,
                    backend=room_lib.reserving(
                        backend, self._room, tenant=record.tenant, source=source, check=check
                    ),
                    output_format=record.output_format or None,
                    overwrite=staged.overwrite,
                    progress=progress_lib.JobProgress(
                        functools.partial(self._update, record.job_id), mirror
                    ),
                    check=check,
                    max_tensor_bytes=self._max_tensor_bytes,
                    # The mirror copies finished parts, not a data file that grows in place.
                    in_place=mirror is None,
                    # AWQ / SmoothQuant's folded norms and biases, in place of the source's.
                    replaced=calibrated.folded if calibrated is not None else None,
                    untie=untie,
                )
                spread = peers_lib.describe_spread(backend)
            staged.publish(overwrite=record.overwrite, check=check)
            if calibrated is not None:
                lm_calibration.discard(destination)  # the output holds it now
                spread += lm_jobs.summary(calibrated)
        except _Stop as stop:
            if stop.cancelled:
                self._remove_partial(destination)
                self._finish(record, pb.JOB_STATE_CANCELLED, "cancelled")
            elif not stop.lost:  # lost: the job is another runner's now; nothing is written
                self._hand_back(record.job_id, mirror)
        except errors.OutputError as e:
            # A full or read-only disk: the message says so, the error what is kept to resume.
            message = f"failed: could not write the output ({e.code})"
            self._finish(record, pb.JOB_STATE_FAILED, message, error=e.details)
        except errors.QmillError as e:
            self._finish(record, pb.JOB_STATE_FAILED, "failed", error=e.details)
        except (server_errors.ServerError, ValueError, TypeError, OSError, RuntimeError) as e:
            self._finish(record, pb.JOB_STATE_FAILED, "failed", error=str(e))
        except Exception:
            log.exception("job %s failed", record.job_id)
            self._finish(record, pb.JOB_STATE_FAILED, "failed", error="internal error")
        else:
            self._finish(record, pb.JOB_STATE_SUCCEEDED, f"wrote {record.destination}{spread}")

    def _mirror(
        self, record: store_lib.JobRecord, staged: scratch_lib.StagedJob
    ) -> mirror_lib.PartialMirror | None:
        """With a shared store, the object-store copy of a URL job's partial output (restored
        first when another runner left one): any replica may have to resume the job."""
        if not self.store.shared or staged.upload_to is None:
            return None
        mirror = mirror_lib.PartialMirror(staged.destination, staged.upload_to, record.job_id)
        fingerprint = pipeline.partial_fingerprint(
            staged.source, staged.destination, record.recipe, record.output_format or None
        )
        restored = mirror.restore(staged.source, fingerprint)
        if restored:
            log.info("job %s resumes: %d tensors already done", record.job_id, restored)
            self._update(record.job_id, message=f"resumed: {restored} tensors already done")
        return mirror

    def _hand_back(self, job_id: str, mirror: mirror_lib.PartialMirror | None) -> None:
        """Queues a job this stopping server was running, for a runner anywhere to resume."""
        try:
            if mirror is not None:
                mirror.sync(force=True)
            self.store.release(job_id, self.owner, "handed back by a stopping server; queued")
            log.info("job %s handed back (server stopping)", job_id)
        except Exception as e:  # any failure: the lease then lapses, the job resumes later
            log.warning("job %s: could not hand it back (%s); its lease will lapse", job_id, e)

    @staticmethod
    def _remove_partial(destination: str) -> None:
        path = pathlib.Path(destination).absolute()
        staging.remove(path.with_name(path.name + staging.PARTIAL_SUFFIX))
        lm_calibration.discard(path)  # a language-model job's kept layers, if any

    def _finish(
        self,
        record: store_lib.JobRecord,
        state: int,
        message: str,
        *,
        error: str = "",
        force: bool = False,
    ) -> store_lib.JobRecord | None:
        job_id = record.job_id
        if job_id in self._abandoned and not force:
            return None  # a job left behind: its state is already final
        log.info("job %s %s%s", job_id, store_lib.state_name(state), f": {error}" if error else "")
        # Before the state changes: whoever sees the job ended sees its scratch gone.
        self.scratch.discard(job_id)
        if self.store.shared:
            mirror_lib.remove(record.destination, job_id)
        while True:  # the outcome, and its true counts, are not lost to a database restart
            try:
                return self._update(job_id, state=state, message=message, error=error, force=force)
            except server_errors.Unavailable as e:
                if self._stopping.is_set():
                    log.warning("job %s: its end could not be recorded: %s", job_id, e)
                    return None
                # Until the backoff's next try, or sooner when a lease renewal finds the
                # database back: the end is written before another replica may claim the job.
                while not self._outage.may_try() and not self._stopping.wait(0.1):
                    pass

    def _update(
        self, job_id: str, *, force: bool = False, **fields: object
    ) -> store_lib.JobRecord | None:
        """Writes `fields` while this runner holds the job (None: it does not any more, or the
        database is away). Progress the database could not take is held, the latest of each
        field, and written with the next write that reaches it: a progress update once the
        outage's next try is due, or the job's final state (which raises Unavailable instead)."""
        if job_id in self._abandoned and not force:
            return None  # progress of a job left behind is not reported
        final = "state" in fields
        with self._lock:
            progress = self._unwritten.pop(job_id, {})
            if not final and not self._outage.may_try():
                self._unwritten[job_id] = {**progress, **fields}  # no connection tried per tensor
                self._outage.held()
                return None
        try:
            record = self.store.update(job_id, owner=self.owner, **{**progress, **fields})
        except server_errors.Unavailable as e:
            with self._lock:  # held for the next try (a final state is the caller's to repeat)
                held = progress if final else {**progress, **fields}
                self._unwritten[job_id] = {**held, **self._unwritten.get(job_id, {})}
            self._outage.failed(e, held=not final)
            if final:
                raise
            return None
        self._outage.answered()
        if final:
            self._notify()
        return record

    def _notify(self) -> None:
        if self._on_change is not None:
            self._on_change()
