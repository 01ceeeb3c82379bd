"""Running the `qmill` CLI as a user does: the installed console script, else `python -m`."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable

import pytest

from tests.e2e import processes


@pytest.fixture(scope="session")
def run_qmill() -> Callable[..., subprocess.CompletedProcess]:
    """`run_qmill(*args)`: the CLI in a child process (5 min at most), output captured."""
    command = processes.qmill()

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*command, *args], capture_output=True, text=True, timeout=300, env=os.environ
        )

    return run
