"""Running the `qmill` CLI as a user does: the installed console script, else `python -m`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest


@pytest.fixture(scope="session")
def run_qmill() -> Callable[..., subprocess.CompletedProcess]:
    """`run_qmill(*args)`: the CLI in a child process (5 min at most), output captured."""
    exe = shutil.which("qmill", path=os.path.dirname(sys.executable))
    command = [exe] if exe else [sys.executable, "-m", "qmill.cli"]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*command, *args], capture_output=True, text=True, timeout=300, env=os.environ
        )

    return run
