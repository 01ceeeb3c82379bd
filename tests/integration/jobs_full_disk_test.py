"""A batch job whose output disk fills up fails and says so; resubmitted, it resumes (issue 18,
item 7). Real server on 127.0.0.1 in this process, so the simulated disk of
tests/checkpoints/full_disk.py applies to the job runner's writes."""

from __future__ import annotations

import numpy as np

from qmill import checkpoints
from qmill.client import Client
from qmill.proto.v1 import qmill_pb2 as pb
from tests.checkpoints import full_disk


def _run_job(server, source, dest):
    with Client(server.address, timeout=120) as client:
        job = client.jobs.submit(str(source), str(dest), "int8")
        return list(client.jobs.watch(job.job_id))[-1].job


def test_a_job_on_a_full_disk_fails_saying_so_and_resumes(make_server, tmp_path, monkeypatch):
    server = make_server()
    source = tmp_path / "src.safetensors"
    with checkpoints.create_writer(source, "safetensors") as writer:
        for i in range(4):
            writer.write(f"layer_{i}/kernel", np.full((64, 64), i + 1, np.float32))
    dest = tmp_path / "out.safetensors"
    # One 64x64 int8 kernel with its scales and log line is about 5 kB: room for one or two.
    full_disk.limit_writes(monkeypatch, 10_000)
    failed = _run_job(server, source, dest)
    assert failed.state == pb.JOB_STATE_FAILED
    assert failed.message == "failed: could not write the output (RESOURCE_EXHAUSTED)"
    assert failed.error.startswith(f"could not write {dest}: no space left on device")
    assert "finished tensor" in failed.error and ".qmill-partial/" in failed.error
    assert not dest.exists()

    monkeypatch.undo()
    done = _run_job(server, source, dest)
    assert done.state == pb.JOB_STATE_SUCCEEDED, done.error
    with checkpoints.open_source(dest) as written:
        assert len(written.entries()) == 4 * 2  # qvalue and scale of each kernel
