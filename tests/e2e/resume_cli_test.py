"""`qmill quantize --server` survives the server dying: re-run (or retry) resumes, same bytes."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

from tests.e2e import processes


class _Server:
    """`qmill serve` on one port, which a test kills and starts again."""

    def __init__(self) -> None:
        self.port = processes.free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.start()

    def start(self) -> None:
        (self.process,) = processes.serve(self.port)

    def kill(self) -> None:
        processes.kill(self.process)


@pytest.fixture
def server():
    running = _Server()
    yield running
    running.kill()


def _killed_mid_run(
    server: _Server, tmp_path: pathlib.Path, retries: str, delay: float, finished: int
) -> tuple[pathlib.Path, pathlib.Path, subprocess.Popen]:
    """(reference output, output of the run, the run): a one-go reference, then a run reading
    each tensor `delay` seconds late whose server is killed once `finished` tensors are done."""
    reference = tmp_path / "reference.npz"
    _, stderr = processes.quantize(reference, server.address).communicate(timeout=120)
    assert reference.exists(), stderr
    out = tmp_path / "out.npz"
    client = processes.quantize(out, server.address, "--retries", retries, delay=delay)
    processes.wait_for_finished_tensors(out, finished, client)
    server.kill()
    return reference, out, client


def test_rerun_after_server_killed_resumes_with_identical_output(tmp_path, server):
    reference, out, client = _killed_mid_run(server, tmp_path, "0", delay=1.0, finished=1)
    _, stderr = client.communicate(timeout=120)
    assert client.returncode == 1, stderr
    assert b"UNAVAILABLE" in stderr and b"Traceback" not in stderr
    assert not out.exists()
    partial = out.with_name("out.npz.qmill-partial")
    finished = len((partial / "tensors.jsonl").read_text().splitlines())
    assert 1 <= finished < 5

    server.start()
    rerun = processes.quantize(out, server.address)
    _, stderr = rerun.communicate(timeout=120)
    assert rerun.returncode == 0, stderr
    assert out.read_bytes() == reference.read_bytes()
    assert not partial.exists()


def test_client_retries_until_the_server_is_back(tmp_path, server):
    reference, out, client = _killed_mid_run(server, tmp_path, "8", delay=0.5, finished=2)
    server.start()
    _, stderr = client.communicate(timeout=180)
    assert client.returncode == 0, stderr
    assert b"server unavailable" in stderr and b"retry 1/8" in stderr
    assert out.read_bytes() == reference.read_bytes()
