"""Batch jobs obey --max-inflight-bytes as streams do, and `jobs cancel` reaches a job wherever
it is (issue 18, items 2 and 3). Real server on 127.0.0.1 in this process."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from qmill import checkpoints
from qmill.checkpoints.formats import registry as formats
from qmill.client import Client
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server.jobs import runner as runner_lib
from tests.integration.limits_test import RECIPE, Stalled, _partial_tensor

KiB = 1024


def _source(path, rows: int, count: int = 1):
    """`count` float32 kernels of rows x 64 (rows * 256 bytes each)."""
    with checkpoints.create_writer(path, "safetensors") as writer:
        for i in range(count):
            writer.write(f"layer_{i}/kernel", np.full((rows, 64), i + 1.5, np.float32))
    return path


def _until(predicate, what: str, seconds: float = 60.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def _job(client: Client, job_id: str) -> pb.Job:
    return client.jobs.get(job_id)


def test_a_job_tensor_over_the_inflight_limit_fails_the_job(make_server, tmp_path):
    server = make_server(max_inflight_bytes=64 * KiB, max_tensor_bytes=1024 * KiB)
    source = _source(tmp_path / "big.safetensors", rows=1024)  # one 256 KiB tensor
    with Client(server.address, timeout=60) as client:
        job = client.jobs.submit(str(source), str(tmp_path / "out.safetensors"), "int8")
        job = list(client.jobs.watch(job.job_id))[-1].job
    assert job.state == pb.JOB_STATE_FAILED
    assert "262144 bytes requested at once, over this server's in-flight limit" in job.error
    assert server.server.limiter.used == 0


def test_a_job_waits_for_room_a_stream_holds_and_cancel_reaches_it(make_server, tmp_path):
    server = make_server(max_inflight_bytes=256 * KiB, max_wait_seconds=0.2)
    limiter = server.server.limiter
    # A stream announces 200 KiB and stalls: its bytes stay reserved.
    held = Stalled(server.address, [RECIPE, *_partial_tensor(200 * KiB, 1 * KiB)])
    try:
        _until(lambda: limiter.used == 200 * KiB, "the stream's bytes are reserved")
        source = _source(tmp_path / "src.safetensors", rows=256, count=3)  # 64 KiB each
        with Client(server.address, timeout=60) as client:
            waiting = client.jobs.submit(str(source), str(tmp_path / "a.safetensors"), "int8")
            _until(lambda: limiter.waiting == 1, "the job queues for room")
            job = _job(client, waiting.job_id)
            assert job.state == pb.JOB_STATE_RUNNING and job.tensors_done == 0
            client.jobs.cancel(waiting.job_id)
            _until(
                lambda: _job(client, waiting.job_id).state == pb.JOB_STATE_CANCELLED,
                "the waiting job is cancelled",
            )
            assert limiter.used == 200 * KiB and limiter.waiting == 0  # it holds nothing

            second = client.jobs.submit(str(source), str(tmp_path / "b.safetensors"), "int8")
            _until(lambda: limiter.waiting == 1, "the next job queues for room")
            held.close()  # the stream ends: its room goes to the job
            done = list(client.jobs.watch(second.job_id))[-1].job
        assert done.state == pb.JOB_STATE_SUCCEEDED, done.error
        assert done.tensors_done == 3
    finally:
        held.close()
    _until(lambda: limiter.used == 0, "every byte is given back")
    assert not (tmp_path / "a.safetensors").exists()


class _BlockingReads:
    """Sources named stuck.* block their first read until `gate` is set."""

    def __init__(self, monkeypatch) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        original = formats.open_source

        def open_source(path):
            source = original(path)
            if "stuck" in str(path):
                read = source.read

                def blocked_read(tensor):
                    self.entered.set()
                    self.gate.wait(120)
                    return read(tensor)

                source.read = blocked_read
            return source

        monkeypatch.setattr(formats, "open_source", open_source)


def test_cancel_reaches_a_job_blocked_in_a_read_and_the_next_job_runs(
    make_server, tmp_path, monkeypatch
):
    server = make_server()
    reads = _BlockingReads(monkeypatch)
    stuck = _source(tmp_path / "stuck.safetensors", rows=16, count=2)
    fine = _source(tmp_path / "fine.safetensors", rows=16, count=2)
    dest = tmp_path / "stuck-int8.safetensors"
    try:
        with Client(server.address, timeout=60) as client:
            job = client.jobs.submit(str(stuck), str(dest), "int8")
            assert reads.entered.wait(60), "the job never read its source"
            client.jobs.cancel(job.job_id)
            _until(
                lambda: _job(client, job.job_id).state == pb.JOB_STATE_CANCELLED,
                "the job blocked in its read is cancelled",
            )
            assert not reads.gate.is_set()  # cancelled while its read was still blocked
            after = client.jobs.submit(str(fine), str(tmp_path / "fine-int8.safetensors"), "int8")
            after = list(client.jobs.watch(after.job_id))[-1].job
            assert after.state == pb.JOB_STATE_SUCCEEDED, after.error

            reads.gate.set()  # the read returns: the job left behind stops at its next check
            name = f"qmill-job-{job.job_id[:8]}"
            _until(
                lambda: name not in {t.name for t in threading.enumerate()},
                "the job left behind ends",
            )
            job = _job(client, job.job_id)
        assert job.state == pb.JOB_STATE_CANCELLED and job.message == "cancelled"
        assert not dest.exists()
        assert not dest.with_name(dest.name + ".qmill-partial").exists()
    finally:
        reads.gate.set()


@pytest.fixture(autouse=True)
def _short_grace(monkeypatch):
    # A cancelled job gets this long to stop by itself before it is left behind.
    monkeypatch.setattr(runner_lib, "CANCEL_GRACE_SECONDS", 0.5)
