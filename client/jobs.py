"""Batch jobs on a server: submit, get, watch, list, cancel (the `qmill submit` / `qmill jobs`
commands).

A job reads its source and writes its destination on the server's filesystem, so the client
sends paths and a recipe, not tensors, and may disconnect: the job keeps running, survives a
server restart, and can be watched again by id. A watch itself goes on across a job database
outage or a server restart (UNAVAILABLE): it is opened again, with a backoff between tries.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from qmill.client import calibrated_lm, errors, lm_jobs, recipes, retry
from qmill.client import connection as connection_lib
from qmill.client import credentials as credentials_lib
from qmill.client.service_client import ServiceClient
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


def describe(job: pb.Job) -> str:
    """One line for a job: id, state, progress, paths, then the error of a failed one or the
    latest message of any other (e.g. how a finished job's tensors were shared by --job-peers)."""
    line = (
        f"{job.job_id}  {state_name(job.state):<9}  {job.tensors_done}/{job.tensors_total} "
        f"tensors  {job.source} → {job.destination}"
    )
    if job.error:
        return f"{line}  error: {job.error}"
    return f"{line}  ({job.message})" if job.message else line


# The CLI's part: `qmill submit` and `qmill jobs list|watch|cancel` (cli.py dispatches here).


def add_commands(sub: Any, recipe_help: str) -> None:
    """Adds the `submit` and `jobs` commands to the CLI's subparsers."""
    s = sub.add_parser(
        "submit",
        help="run a quantize job on a server (server-side paths)",
        epilog=lm_jobs.SUBMIT_HELP,
    )
    s.add_argument("source", help="checkpoint path on the server")
    s.add_argument("destination", help="where the server writes the quantized checkpoint")
    s.add_argument("--server", required=True, help="HOST:PORT")
    s.add_argument("--recipe", default="int8", help=recipe_help)
    s.add_argument(
        "--format",
        choices=("orbax", "safetensors", "npz", "compressed-tensors"),
        help="output format (a compressed-tensors scheme --recipe implies compressed-tensors)",
    )
    s.add_argument(
        "--group-size",
        type=int,
        help="input features per scale in the recipe's grouped rules (W4A16's default 128)",
    )
    s.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    s.add_argument("--watch", action="store_true", help="follow the job until it ends")
    calibrated_lm.add_arguments(s)
    credentials_lib.add_arguments(s)  # --request-id doubles as the job's idempotency key

    j = sub.add_parser("jobs", help="list, watch or cancel jobs on a server")
    jsub = j.add_subparsers(dest="jobs_command", required=True)
    ls = jsub.add_parser("list", help="this tenant's jobs, oldest first")
    ls.add_argument("--all-tenants", action="store_true", help="every tenant's (admin token)")
    for name, text in (("watch", "follow a job until it ends"), ("cancel", "cancel a job")):
        p = jsub.add_parser(name, help=text)
        p.add_argument("job_id")
    for p in jsub.choices.values():
        p.add_argument("--server", required=True, help="HOST:PORT")
        credentials_lib.add_arguments(p)


def run_command(client: ServiceClient, args: Any, print_line: Any) -> int:
    """Runs `submit` or `jobs ...`; returns the exit code (1 when a watched job did not succeed)."""
    jobs = client.jobs
    if args.command == "submit":
        recipe = recipes.load(args.recipe)
        if args.group_size is not None:
            recipe = recipes.with_group_size(recipe, args.group_size)
        job = jobs.submit(
            args.source,
            args.destination,
            recipe,
            request_id=args.request_id or "",
            output_format=recipes.output_format(args.recipe, args.format) or "",
            overwrite=args.overwrite,
            language_model=lm_jobs.from_args(args, print_line),
        )
        print_line(describe(job))
        return _watch(jobs, job.job_id, print_line) if args.watch else 0
    if args.jobs_command == "list":
        for job in jobs.list(all_tenants=args.all_tenants):
            print_line(describe(job))
        return 0
    if args.jobs_command == "cancel":
        job = jobs.cancel(args.job_id)
        print_line(describe(job))
        if job.state in (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED):
            # Cancelling changed nothing: said, not left to a state a reader may skim. Still
            # exit 0, as for a job cancelled twice: the job is not running either way.
            print(
                f"qmill: job {job.job_id} had already {state_name(job.state)}: nothing was "
                "cancelled",
                file=sys.stderr,
            )
        return 0
    return _watch(jobs, args.job_id, print_line)


def _watch(jobs: Jobs, job_id: str, print_line: Any) -> int:
    job = None

    def interrupted(line: str) -> None:
        print(f"qmill: {line}", file=sys.stderr, flush=True)

    for event in jobs.watch(job_id, on_retry=interrupted):
        job = event.job
        print_line(
            f"{state_name(job.state)}: {event.message} "
            f"({job.tensors_done}/{job.tensors_total} tensors, {job.bytes_done:,} bytes)"
        )
    if job is None or job.state != pb.JOB_STATE_SUCCEEDED:
        error = f": {job.error}" if job is not None and job.error else ""
        raise errors.QmillError(
            "FAILED_PRECONDITION" if job is None else state_name(job.state).upper(),
            f"job {job_id} did not succeed{error}",
        )
    return 0
