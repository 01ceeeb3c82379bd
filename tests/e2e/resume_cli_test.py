"""`qmill quantize --server` survives the server dying: re-run (or retry) resumes, same bytes."""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = ROOT / "examples" / "tiny-mlp"  # 5 float tensors and one int32


def _qmill() -> list[str]:
    exe = shutil.which("qmill", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "qmill.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        [*_qmill(), "serve", "--port", str(port), "--grace", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        caps = subprocess.run(
            [*_qmill(), "capabilities", "--server", f"127.0.0.1:{port}"],
            capture_output=True,
            timeout=60,
        )
        if caps.returncode == 0:
            return server
        assert server.poll() is None, "qmill serve exited"
        time.sleep(0.3)
    server.kill()
    raise AssertionError("qmill serve did not come up")


def _quantize(out: pathlib.Path, port: int, *extra: str, delay: float = 0.0, **kw):
    env = {**os.environ, "QMILL_TEST_TENSOR_DELAY": str(delay)}
    args = [*_qmill(), "quantize", str(SOURCE), "-o", str(out), "--format", "npz", "-q"]
    args += ["--server", f"127.0.0.1:{port}", *extra]
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def _wait_for_finished_tensors(out: pathlib.Path, count: int, process: subprocess.Popen) -> None:
    log = out.with_name(out.name + ".qmill-partial") / "tensors.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if log.exists() and len(log.read_text().splitlines()) >= count:
            return
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    raise AssertionError(f"{log} never listed {count} tensors")


def _kill(server: subprocess.Popen) -> None:
    server.kill()  # SIGKILL: no graceful shutdown, streams cut mid-call
    server.wait(30)


def test_rerun_after_server_killed_resumes_with_identical_output(tmp_path):
    port = _free_port()
    server = _serve(port)
    try:
        reference = tmp_path / "reference.npz"
        _, stderr = _quantize(reference, port).communicate(timeout=120)
        assert reference.exists(), stderr

        out = tmp_path / "out.npz"
        client = _quantize(out, port, "--retries", "0", delay=1.0)
        _wait_for_finished_tensors(out, 1, client)
        _kill(server)
        _, stderr = client.communicate(timeout=120)
        assert client.returncode == 1, stderr
        assert b"UNAVAILABLE" in stderr and b"Traceback" not in stderr
        assert not out.exists()
        partial = out.with_name("out.npz.qmill-partial")
        finished = len((partial / "tensors.jsonl").read_text().splitlines())
        assert 1 <= finished < 5

        server = _serve(port)
        rerun = _quantize(out, port)
        _, stderr = rerun.communicate(timeout=120)
        assert rerun.returncode == 0, stderr
        assert out.read_bytes() == reference.read_bytes()
        assert not partial.exists()
    finally:
        _kill(server)


def test_client_retries_until_the_server_is_back(tmp_path):
    port = _free_port()
    server = _serve(port)
    try:
        reference = tmp_path / "reference.npz"
        _, stderr = _quantize(reference, port).communicate(timeout=120)
        assert reference.exists(), stderr
        out = tmp_path / "out.npz"
        client = _quantize(out, port, "--retries", "8", delay=0.5)
        _wait_for_finished_tensors(out, 2, client)
        _kill(server)
        server = _serve(port)
        _, stderr = client.communicate(timeout=180)
        assert client.returncode == 0, stderr
        assert b"server unavailable" in stderr and b"retry 1/8" in stderr
        assert out.read_bytes() == reference.read_bytes()
    finally:
        _kill(server)
