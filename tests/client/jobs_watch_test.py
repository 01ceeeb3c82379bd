"""`qmill jobs watch` across a job database outage or a server restart (issue 39): the watch is
opened again after UNAVAILABLE, events are not repeated, and other failures still end it.

Nothing here imports jax: a fake Jobs servicer plays the server.
"""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

from qmill.client import AsyncClient, Client, QmillError, jobs, retry
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc

QUICK = retry.Backoff(retries=3, initial_seconds=0.01, max_seconds=0.01)


def _event(state: int, done: int) -> pb.JobEvent:
    message = f"tensor {done}/3 done" if state == pb.JOB_STATE_RUNNING else "wrote out.npz"
    job = pb.Job(job_id="j1", state=state, tensors_done=done, tensors_total=3, message=message)
    return pb.JobEvent(job=job, message=message)


class FlakyJobs(pb_grpc.JobsServicer):
    """Each WatchJob call plays the next script: events, then a status or the end."""

    def __init__(self, scripts) -> None:
        self.scripts = list(scripts)
        self.calls = 0

    def WatchJob(self, request, context):
        self.calls += 1
        events, code = self.scripts.pop(0)
        yield from events
        if code is not None:
            context.abort(code, f"the job database is unreachable ({code.name}); retry")


def _serve(scripts):
    servicer = FlakyJobs(scripts)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_JobsServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, servicer, f"127.0.0.1:{port}"


RUNNING_1, RUNNING_2 = _event(pb.JOB_STATE_RUNNING, 1), _event(pb.JOB_STATE_RUNNING, 2)
DONE = _event(pb.JOB_STATE_SUCCEEDED, 3)
OUTAGE = [
    ([RUNNING_1], grpc.StatusCode.UNAVAILABLE),  # the database went away mid-watch
    ([], grpc.StatusCode.UNAVAILABLE),  # still away
    ([RUNNING_1, RUNNING_2], None),  # back: the job as it is (1/3 again), then on; but the
    ([RUNNING_2, DONE], None),  # stream ended before the job (a replica stopping)
]


def _progress(events) -> list[tuple[int, int]]:
    return [(e.job.state, e.job.tensors_done) for e in events]


WANT = [(pb.JOB_STATE_RUNNING, 1), (pb.JOB_STATE_RUNNING, 2), (pb.JOB_STATE_SUCCEEDED, 3)]


def test_a_watch_reconnects_across_an_outage_without_repeating_events():
    server, servicer, address = _serve(OUTAGE)
    lines: list[str] = []
    try:
        with Client(address) as client:
            events = list(client.jobs.watch("j1", backoff=QUICK, on_retry=lines.append))
    finally:
        server.stop(0)
    assert _progress(events) == WANT
    assert servicer.calls == 4
    assert len(lines) == 3 and all("watch of job j1 interrupted" in line for line in lines)
    assert "job database is unreachable" in lines[0] and "ended early" in lines[2]


def test_an_async_watch_reconnects_too():
    server, _, address = _serve(OUTAGE)

    async def watch():
        async with AsyncClient(address) as client:
            return [e async for e in client.jobs.watch("j1", backoff=QUICK)]

    try:
        events = asyncio.run(watch())
    finally:
        server.stop(0)
    assert _progress(events) == WANT


def test_other_failures_and_spent_retries_end_the_watch():
    server, _, address = _serve([([RUNNING_1], grpc.StatusCode.NOT_FOUND)])
    try:
        with Client(address) as client, pytest.raises(QmillError) as e:
            list(client.jobs.watch("j1", backoff=QUICK))
        assert e.value.code == "NOT_FOUND"
    finally:
        server.stop(0)
    away = [([], grpc.StatusCode.UNAVAILABLE)] * 4
    server, servicer, address = _serve(away)
    try:
        with Client(address) as client, pytest.raises(QmillError) as e:
            list(client.jobs.watch("j1", backoff=QUICK))
        assert e.value.code == "UNAVAILABLE" and servicer.calls == 4  # 1 + 3 retries
    finally:
        server.stop(0)


def test_the_default_backoff_waits_long_enough_for_a_database_restart():
    assert sum(jobs.WATCH_BACKOFF.delays()) > 60
