"""Checks on the files a checkpoint is read from."""

from __future__ import annotations

import os
import pathlib
import stat


def require_regular_file(path: pathlib.Path) -> None:
    """Refuses FIFOs, sockets and devices before anything opens them: reading a FIFO blocks
    until a writer appears, which wedged a server's job runner (and every job queued behind it).

    Raises:
        ValueError: `path` is not a regular file (symlinks to regular files are fine).
    """
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
        raise ValueError(f"{path} is {kind}; qmill reads checkpoints from regular files only")
