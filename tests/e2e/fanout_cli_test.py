"""`qmill quantize --server a,b,c`: one checkpoint over three `qmill serve` processes, one of them
killed part way; the output is the one-server output byte for byte."""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

from qmill.client import Client, errors

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = ROOT / "examples" / "tiny-mlp"  # 5 float tensors and one int32


def _qmill() -> list[str]:
    exe = shutil.which("qmill", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "qmill.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_three() -> tuple[list[subprocess.Popen], list[str]]:
    ports = [_free_port() for _ in range(3)]
    servers = [
        subprocess.Popen(
            [*_qmill(), "serve", "--port", str(p), "--grace", "1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for p in ports
    ]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    deadline = time.monotonic() + 180
    for server, address in zip(servers, addresses, strict=True):
        while True:
            assert server.poll() is None, "qmill serve exited"
            assert time.monotonic() < deadline, "qmill serve did not come up"
            try:
                with Client(address, timeout=5) as client:
                    client.capabilities()
                break
            except errors.QmillError:
                time.sleep(0.3)
    return servers, addresses


def _quantize(out: pathlib.Path, server: str, delay: float = 0.0) -> subprocess.Popen:
    env = {**os.environ, "QMILL_TEST_TENSOR_DELAY": str(delay)}
    args = [*_qmill(), "quantize", str(SOURCE), "-o", str(out), "--format", "npz", "-q"]
    args += ["--server", server, "--retries", "0"]  # no retry: the fan-out alone must cope
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_finished_tensors(out: pathlib.Path, count: int, process: subprocess.Popen) -> None:
    log = out.with_name(out.name + ".qmill-partial") / "tensors.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if log.exists() and len(log.read_text().splitlines()) >= count:
            return
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    raise AssertionError(f"{log} never listed {count} tensors")


def test_three_servers_one_killed_give_the_one_server_checkpoint(tmp_path):
    servers, addresses = _serve_three()
    try:
        reference = tmp_path / "one-server.npz"
        one = _quantize(reference, addresses[0])
        one_stdout, stderr = one.communicate(timeout=120)
        assert one.returncode == 0, stderr

        out = tmp_path / "three.npz"
        run = _quantize(out, ",".join(addresses), delay=0.5)
        _wait_for_finished_tensors(out, 2, run)
        servers[1].kill()  # SIGKILL: its stream is cut mid-call
        servers[1].wait(30)
        stdout, stderr = run.communicate(timeout=120)
        assert run.returncode == 0, stderr
        assert f"replica {addresses[1]} failed".encode() in stderr, stderr
        assert b"Traceback" not in stderr
        assert out.read_bytes() == reference.read_bytes()
        # The same totals line ("4/6 tensors quantized, … smaller"), the time aside.
        assert stdout.split(b" in ")[0] == one_stdout.split(b" in ")[0]
    finally:
        for server in servers:
            server.kill()
            server.wait(30)
