"""Test-only: an output disk that fills up, or is read-only, for the pipeline's own writes.

The partial output (staging.py) and the safetensors writer open their files with the builtin
`open`; this puts a wrapper in front of it in those two modules only, so the source is read as
usual while every file opened for writing shares one byte budget. A write past the budget raises
OSError(ENOSPC) as a full disk does; `budget=-1` makes opening for writing raise OSError(EROFS)
as a read-only file system does. Nothing in qmill itself knows about it.

- In the test's own process: ``limit_writes(monkeypatch, budget)``.
- In a child process (the CLI): ``qmill_command(budget)`` is the command line that installs the
  same wrapper and then runs the ``qmill`` CLI with the arguments that follow.
"""

from __future__ import annotations

import builtins
import errno
import os
import pathlib
import sys
from typing import Any

from qmill.checkpoints.base import staging
from qmill.checkpoints.formats.safetensors import writer as safetensors_writer

_MODULES = (staging, safetensors_writer)


class _Disk:
    def __init__(self, budget: int) -> None:
        self.free = budget

    def open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if not any(flag in mode for flag in "wax+"):
            return builtins.open(file, mode, *args, **kwargs)
        if self.free < 0:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(file))
        return _LimitedFile(builtins.open(file, mode, *args, **kwargs), self)


class _LimitedFile:
    """A file whose writes draw on the disk's free bytes."""

    def __init__(self, file: Any, disk: _Disk) -> None:
        self._file, self._disk = file, disk

    def write(self, data: Any) -> int:
        size = len(data) if isinstance(data, str) else memoryview(data).nbytes
        if size > self._disk.free:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._disk.free -= size
        return self._file.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __enter__(self) -> _LimitedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def limit_writes(monkeypatch: Any, budget: int) -> None:
    """Files the pipeline opens for writing from now on share `budget` bytes (-1: read-only)."""
    disk = _Disk(budget)
    for module in _MODULES:
        monkeypatch.setattr(module, "open", disk.open, raising=False)


def qmill_command(budget: int) -> list[str]:
    """`qmill` in a child process whose output disk has `budget` bytes free; append its args."""
    return [sys.executable, str(pathlib.Path(__file__).resolve()), str(budget)]


def _main(argv: list[str]) -> int:
    disk = _Disk(int(argv[0]))
    for module in _MODULES:
        module.open = disk.open  # type: ignore[attr-defined]
    from qmill.cli import main as cli  # after the wrapper is in place

    return cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
