"""Running the `qmill` CLI as a user does: the installed console script, else `python -m`."""

from __future__ import annotations

import os
import pathlib
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


_HERE = pathlib.Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here runs the `qmill` command in processes of its own (each start imports
    jax): all are `slow`, left out of the edit-test loop (`pytest -m "not slow"`); CI runs them."""
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.slow)
