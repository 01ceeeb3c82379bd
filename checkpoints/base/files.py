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


def require_regular_tree(root: pathlib.Path) -> None:
    """Refuses a checkpoint directory holding a FIFO, socket or device anywhere inside: Orbax
    opens its data files itself, and a FIFO among them blocked the job runner as a FIFO source
    did.

    Raises:
        ValueError: an entry under `root` is neither a directory nor a regular file.
    """
    for path in root.rglob("*"):
        if not stat.S_ISDIR(os.stat(path).st_mode):
            require_regular_file(path)
