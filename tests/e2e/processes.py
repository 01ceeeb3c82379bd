"""The `qmill` processes of the e2e tests: the CLI as a user runs it, `qmill serve` on free ports,
and `qmill quantize` runs whose checkpoint reads can be slowed down so a test can stop them (or
their servers) part way."""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time

from tests.checkpoints import slow_reads

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = ROOT / "examples" / "tiny-mlp"  # 5 float tensors and one int32


def qmill(read_delay: float = 0.0) -> list[str]:
    """The installed console script, else `python -m qmill.cli`; with a read delay, the CLI whose
    checkpoint reads wait `read_delay` seconds each (tests/checkpoints/slow_reads.py)."""
    if read_delay:
        return slow_reads.qmill_command(read_delay)
    exe = shutil.which("qmill", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "qmill.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(*ports: int, extra: tuple[str, ...] = ()) -> list[subprocess.Popen]:
    """`qmill serve` on each port (with the flags `extra`), started together; returns once every
    one answers."""
    servers = [
        subprocess.Popen(
            [*qmill(), "serve", "--port", str(port), "--grace", "1", *extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for port in ports
    ]
    deadline = time.monotonic() + 60 + 60 * len(ports)
    for server, port in zip(servers, ports, strict=True):
        while not _answers(port):
            if server.poll() is not None or time.monotonic() > deadline:
                for s in servers:
                    kill(s)
                raise AssertionError(f"qmill serve on port {port} did not come up")
            time.sleep(0.3)
    return servers


def _answers(port: int) -> bool:
    """Whether the server on `port` answers a GetCapabilities call (from this process: a `qmill
    capabilities` process per poll cost ~0.7 s of CPU each, several per server start)."""
    from qmill.checkpoints.base.errors import QmillError
    from qmill.client import Client

    try:
        with Client(f"127.0.0.1:{port}", timeout=10) as client:
            client.capabilities()
    except QmillError:  # not up yet: UNAVAILABLE
        return False
    return True


def kill(process: subprocess.Popen) -> None:
    process.kill()  # SIGKILL: no graceful shutdown, streams cut mid-call
    process.wait(30)


def quantize(out: pathlib.Path, server: str, *extra: str, delay: float = 0.0) -> subprocess.Popen:
    """`qmill quantize` of SOURCE to `out` (npz) through `server` (addresses, comma-separated),
    each tensor read `delay` seconds late; output captured."""
    args = [*qmill(delay), "quantize", str(SOURCE), "-o", str(out), "--format", "npz", "-q"]
    args += ["--server", server, *extra]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for_finished_tensors(out: pathlib.Path, count: int, process: subprocess.Popen) -> None:
    """Returns once the partial output of `out` lists `count` finished tensors."""
    log = out.with_name(out.name + ".qmill-partial") / "tensors.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if log.exists() and len(log.read_text().splitlines()) >= count:
            return
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    raise AssertionError(f"{log} never listed {count} tensors")
