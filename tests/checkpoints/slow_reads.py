"""Test-only: checkpoint reads that take a while, so a test can interrupt a run part way.

Every source that ``qmill.checkpoints.formats.open_source`` opens sleeps ``seconds`` before each
``read``: the resumable pipeline reads each tensor just before it sends it, so a run (or the
server it streams to) can be stopped after a few tensors. Nothing in qmill itself knows about it.

- In the test's own process: ``delay_reads(monkeypatch, seconds)`` (0 puts the plain reads back).
- In a child process (the CLI, ``qmill serve``): ``qmill_command(seconds)`` is the command line
  that installs the same wrapper and then runs the ``qmill`` CLI with the arguments that follow.
"""

from __future__ import annotations

import functools
import pathlib
import sys
import time
from typing import Any

from qmill.checkpoints.base import protocols
from qmill.checkpoints.formats import registry as formats

_OPEN_SOURCE = formats.open_source


def _open_slowly(seconds: float, path: Any) -> protocols.TensorSource:
    source = _OPEN_SOURCE(path)
    read = source.read

    def slow_read(tensor: str) -> Any:
        time.sleep(seconds)
        return read(tensor)

    # The instance keeps its class (writers look at `like=source`); only its reads slow down.
    source.read = slow_read  # type: ignore[method-assign]
    return source


def _opener(seconds: float) -> Any:
    return functools.partial(_open_slowly, seconds) if seconds else _OPEN_SOURCE


def delay_reads(monkeypatch: Any, seconds: float) -> None:
    """Sources opened from now on (until the test ends) sleep `seconds` before each read."""
    monkeypatch.setattr(formats, "open_source", _opener(seconds))


def qmill_command(seconds: float) -> list[str]:
    """`qmill` in a child process whose checkpoint reads sleep `seconds` each; append its args."""
    return [sys.executable, str(pathlib.Path(__file__).resolve()), str(seconds)]


def _main(argv: list[str]) -> int:
    formats.open_source = _opener(float(argv[0]))
    from qmill.cli import main as cli  # after the wrapper is in place

    return cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
