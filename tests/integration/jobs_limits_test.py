"""Batch jobs obey the server's --max-tensor-bytes as streams do (issue 18, item 2).

A 4 KB sparse safetensors file declaring one 2 GiB tensor was refused when streamed but quantized
as a job, taking the server from 210 MB to 7 GB. Real server on 127.0.0.1, single-user mode.
"""

from __future__ import annotations

import json

import numpy as np

from qmill import checkpoints
from qmill.client import Client
from qmill.proto.v1 import qmill_pb2 as pb


def _sparse_safetensors(path, nbytes: int) -> None:
    """A valid safetensors file whose one tensor spans `nbytes` of holes (no disk used)."""
    header = json.dumps(
        {"w/kernel": {"dtype": "F32", "shape": [nbytes // 4], "data_offsets": [0, nbytes]}}
    ).encode()
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + nbytes)


def test_a_job_with_a_tensor_over_the_limit_fails_before_reading_it(make_server, tmp_path):
    server = make_server(max_tensor_bytes=1024 * 1024)
    huge = tmp_path / "huge.safetensors"
    _sparse_safetensors(huge, 2 * 1024**3)
    fine = tmp_path / "fine.safetensors"
    with checkpoints.create_writer(fine, "safetensors") as writer:
        writer.write("w/kernel", np.ones((64, 64), np.float32))
    with Client(server.address, timeout=60) as client:
        refused = client.jobs.submit(str(huge), str(tmp_path / "out.safetensors"), "int8")
        refused = list(client.jobs.watch(refused.job_id))[-1].job
        done = client.jobs.submit(str(fine), str(tmp_path / "fine-int8.safetensors"), "int8")
        done = list(client.jobs.watch(done.job_id))[-1].job
    assert refused.state == pb.JOB_STATE_FAILED
    assert "2,147,483,648 bytes" in refused.error and "--max-tensor-bytes" in refused.error
    assert not (tmp_path / "out.safetensors").exists()
    assert done.state == pb.JOB_STATE_SUCCEEDED, done.error  # the limit is per tensor
