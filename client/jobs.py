"""Batch jobs on a server: submit, get, watch, list, cancel (the Jobs service; the `qmill submit`
commands).

A job reads its source and writes its destination on the server's filesystem, so the client
sends paths and a recipe, not tensors, and may disconnect: the job keeps running, survives a
server restart, and can be watched again by id. A watch itself goes on across a job database
outage or a server restart (UNAVAILABLE): it is opened again, with a backoff between tries.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from qmill.client import connection as connection_lib
from qmill.client import errors, recipes, retry
from qmill.proto.v1 import qmill_pb2 as pb

FINAL_STATES = (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)
# Waits between tries to open a watch again (0.5 s, doubling to 10 s: about 85 s in all); they
# are counted afresh once the server answers again.
WATCH_BACKOFF = retry.Backoff(retries=12, initial_seconds=0.5, max_seconds=10.0)


def state_name(state: int) -> str:
    """ "succeeded" for JOB_STATE_SUCCEEDED, and so on."""
    return pb.JobState.Name(state).removeprefix("JOB_STATE_").lower()


class Jobs:
    """The Jobs service of a Client (`client.jobs`); every failure is raised as QmillError.

    On an AsyncClient each method returns an awaitable, and `watch` an async iterator.
    """

    def __init__(self, connection: Any) -> None:
        """`connection`: the client's connection.Connection or connection.AsyncConnection."""
        self._connection = connection

    def submit(
        self,
        source: str,
        destination: str,
        recipe: recipes.Recipe,
        *,
        request_id: str = "",
        output_format: str = "",
        overwrite: bool = False,
        language_model: pb.LanguageModelCalibration | None = None,
    ) -> pb.Job:
        """Starts a job (paths are the server's), or returns the one with this request_id.

        `recipe`: a preset name, a TOML recipe file or a mapping. `language_model`: the source
        is a Hugging Face causal-LM folder to calibrate first (lm_jobs.message makes it).
        """
        request = pb.SubmitJobRequest(
            source=source,
            destination=destination,
            recipe=recipes.message(recipe),
            request_id=request_id,
            output_format=output_format,
            overwrite=overwrite,
            language_model=language_model,
        )
        return self._connection.unary("Jobs", "SubmitJob", request)

    def get(self, job_id: str) -> pb.Job:
        return self._connection.unary("Jobs", "GetJob", pb.GetJobRequest(job_id=job_id))

    def cancel(self, job_id: str) -> pb.Job:
        return self._connection.unary("Jobs", "CancelJob", pb.GetJobRequest(job_id=job_id))

    def list(self, *, states: list[int] | None = None, all_tenants: bool = False) -> list[pb.Job]:
        request = pb.ListJobsRequest(states=states or [], all_tenants=all_tenants)
        return self._connection.unary("Jobs", "ListJobs", request, then=_jobs)

    def watch(
        self,
        job_id: str,
        *,
        backoff: retry.Backoff = WATCH_BACKOFF,
        on_retry: Callable[[str], None] = lambda _: None,
    ) -> Iterator[pb.JobEvent]:
        """The job now, then an event per change until it ends (no timeout: jobs take long).

        A watch cut by UNAVAILABLE (the job database away, the server restarting) or ended
        before the job did is opened again after the next of `backoff`'s waits (`on_retry` is
        told one line each); an event the reopened watch repeats is not yielded twice.

        Raises:
            errors.QmillError: any other failure, or UNAVAILABLE once `backoff`'s retries are
                spent without an answer.
        """
        request = pb.GetJobRequest(job_id=job_id)

        def open_watch() -> Any:
            return self._connection.stream("Jobs", "WatchJob", request, _same, timeout=None)

        watch = _Rewatch(job_id, backoff, on_retry)
        if isinstance(self._connection, connection_lib.AsyncConnection):
            return watch.run_async(open_watch)
        return watch.run(open_watch)


class _Rewatch:
    """The state a watch keeps across its reopenings: what was yielded last, the retries."""

    def __init__(
        self, job_id: str, backoff: retry.Backoff, on_retry: Callable[[str], None]
    ) -> None:
        self._job_id = job_id
        self._delays = backoff.delays()
        self._on_retry = on_retry
        self._failures = 0
        self._last: tuple[Any, ...] | None = None
        self.ended = False

    def new(self, event: pb.JobEvent) -> bool:
        """Whether `event` is news (not the one a reopened watch starts with again)."""
        self._failures = 0  # the server answered
        job = event.job
        self.ended = job.state in FINAL_STATES
        seen = (job.state, job.tensors_done, job.tensors_total, job.bytes_done, event.message)
        if seen == self._last:
            return False
        self._last = seen
        return True

    def delay(self, error: errors.QmillError | None) -> float:
        """The wait before reopening after `error` (None: the watch ended before the job);
        raises `error` when it is not worth a retry or the retries are spent."""
        if (error is not None and error.code != "UNAVAILABLE") or self._failures >= len(
            self._delays
        ):
            raise error or errors.QmillError(
                "UNAVAILABLE", f"the watch of job {self._job_id} kept ending before the job"
            )
        delay = self._delays[self._failures]
        self._failures += 1
        reason = error.details.splitlines()[0] if error and error.details else "it ended early"
        self._on_retry(
            f"watch of job {self._job_id} interrupted ({reason}); reconnecting "
            f"{self._failures}/{len(self._delays)} in {delay:.1f} s"
        )
        return delay

    def run(self, open_watch: Callable[[], Iterator[pb.JobEvent]]) -> Iterator[pb.JobEvent]:
        while True:
            error = None
            try:
                for event in open_watch():
                    if self.new(event):
                        yield event
            except errors.QmillError as e:
                error = e
            if self.ended:
                return
            time.sleep(self.delay(error))

    async def run_async(
        self, open_watch: Callable[[], AsyncIterator[pb.JobEvent]]
    ) -> AsyncIterator[pb.JobEvent]:
        while True:
            error = None
            try:
                async for event in open_watch():
                    if self.new(event):
                        yield event
            except errors.QmillError as e:
                error = e
            if self.ended:
                return
            await asyncio.sleep(self.delay(error))


def _jobs(response: pb.ListJobsResponse) -> list[pb.Job]:
    return list(response.jobs)


def _same(event: pb.JobEvent) -> pb.JobEvent:
    return event
