"""A user's first day, part II (issue 38): what qmill used to do silently or noisily, run as a
user runs it — the `qmill` CLI in a child process."""

from __future__ import annotations

import subprocess
import sys

from qmill.server import auth
from tests.e2e import processes

TIMEOUT = 300

# `qmill` whose checkpoint reads after the first wait until the interpreter is exiting (its
# executors shut down): what happened, 1 run in 3, when a call was refused while grpc's request
# thread was reading the next tensor as the process exited.
_READS_AT_EXIT = """
import sys, time
from concurrent.futures import thread
from qmill.checkpoints import formats
from qmill.cli import main as cli

open_source = formats.open_source

def open_late(path):
    source = open_source(path)
    read, reads = source.read, []

    def late_read(tensor):
        reads.append(tensor)
        deadline = time.monotonic() + 20
        while len(reads) > 1 and not thread._shutdown and time.monotonic() < deadline:
            time.sleep(0.001)
        return read(tensor)

    source.read = late_read
    return source

formats.open_source = open_late
sys.exit(cli.main(sys.argv[1:]))
"""


def _qmill(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*processes.qmill(), *args], capture_output=True, text=True, timeout=TIMEOUT
    )


def test_a_refused_call_prints_one_line_and_no_traceback(make_server, tmp_path):
    running = make_server(tokens=auth.TokenTable.from_mapping({"t": {"tenant": "a"}}))
    for i in range(20):
        run = subprocess.run(
            [sys.executable, "-c", _READS_AT_EXIT, "quantize", str(processes.SOURCE), "-o",
             str(tmp_path / f"out{i}.npz"), "-q", "--server", running.address],
            capture_output=True, text=True, timeout=TIMEOUT,
        )  # fmt: skip
        assert run.returncode == 1, run.stderr
        assert run.stderr.startswith("qmill: error: UNAUTHENTICATED: missing bearer token")
        assert run.stderr.count("\n") == 1, run.stderr
