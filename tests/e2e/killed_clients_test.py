"""Clients killed with SIGKILL while the server writes their responses (issue 29).

Each of the rounds starts a client process that streams four 16 MiB float32 tensors, waits for
the first result and is killed while the server is still answering. Every such call must be one
INFO line of the server's log saying CANCELLED (no ERROR, no traceback from grpc's core), the
server's peak RSS must stay within the README's sizing formula, and once the clients are gone
its RSS must be back near the level after one completed call.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import time

from qmill.server.quantizer import stream
from tests.e2e import processes

ROUNDS = 8
MiB = 1024 * 1024
TENSOR_BYTES = 16 * MiB
INFLIGHT_BYTES = 64 * MiB
WORKERS = 2

# Streams four tensors; prints once the first result is in, then waits to be killed.
CLIENT = textwrap.dedent(
    """
    import sys, time, numpy as np
    from qmill.client import Client
    tensors = [(f"w{i}", np.full((1024, 4096), i + 0.5, np.float32)) for i in range(4)]
    with Client(sys.argv[1], timeout=120) as client:
        for n, outcome in enumerate(client.quantize("int8", iter(tensors))):
            print(outcome.path, flush=True)
            if sys.argv[2] == "kill":
                time.sleep(60)
    """
)


def _status(pid: int, field: str) -> float:
    """VmRSS or VmHWM (peak RSS) of a process, in MB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for {pid}")


def _client(address: str, mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT, address, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def test_killed_clients_are_info_lines_and_give_their_memory_back(tmp_path):
    port = processes.free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        args = [
            "serve", "--port", str(port), "--grace", "1", "--data-dir", str(tmp_path / "data"),
            "--workers", str(WORKERS), "--max-inflight-bytes", str(INFLIGHT_BYTES),
        ]  # fmt: skip
        server = subprocess.Popen(
            [*processes.qmill(), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    address = f"127.0.0.1:{port}"
    try:
        # One completed call first: JAX and the shape's compiled code are then in the idle level.
        deadline = time.monotonic() + 120
        while _finished(_client(address, "finish")) != 0:
            assert time.monotonic() < deadline and server.poll() is None, log_path.read_text()
            time.sleep(0.5)
        idle = _settled(server.pid)
        with open(f"/proc/{server.pid}/clear_refs", "w") as f:
            f.write("5")  # VmHWM, the peak RSS, starts again from here: the killed clients'
        for n in range(1, ROUNDS + 1):
            client = _client(address, "kill")
            assert client.stdout.readline(), "the client got no result"
            client.send_signal(signal.SIGKILL)
            client.wait(30)
            client.stdout.close()
            # One client at a time (the formula counts clients sending at once): the next starts
            # once the server has ended this call, and given its memory back (a second later).
            _wait_for_lines(log_path, n)
            time.sleep(2 * stream.LATE_TRIM_SECONDS)
        after = _settled(server.pid)
        peak = _status(server.pid, "VmHWM")
    finally:
        server.terminate()
        server.wait(30)
    lines = log_path.read_text().splitlines()
    assert not [line for line in lines if " ERROR " in line or "Traceback" in line], lines
    cancelled = [line for line in lines if re.search(r"QuantizeParams .*code=CANCELLED", line)]
    assert len(cancelled) == ROUNDS, lines
    assert all(" INFO " in line for line in cancelled)
    # README: about 300 MB (the idle server, measured here) + the bytes in flight + the largest
    # tensor per worker + 60 MB per client sending at once (one at a time here).
    formula = max(300, idle) + (INFLIGHT_BYTES + WORKERS * TENSOR_BYTES) / MiB + 60
    assert peak <= formula, f"peak RSS {peak:.0f} MB over the sizing formula {formula:.0f} MB"
    assert after <= idle + 64, f"RSS {after:.0f} MB after the killed clients, idle {idle:.0f} MB"


def _wait_for_lines(log_path, count: int) -> None:
    deadline = time.monotonic() + 30
    while len(re.findall(r"QuantizeParams .*code=CANCELLED", log_path.read_text())) < count:
        assert time.monotonic() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.05)


def _finished(client: subprocess.Popen) -> int:
    client.communicate(timeout=120)
    return client.returncode


def _settled(pid: int, seconds: float = 2.0) -> float:
    """The RSS once it stops moving (calls just cancelled are still being cleaned up)."""
    time.sleep(seconds)
    return _status(pid, "VmRSS")
