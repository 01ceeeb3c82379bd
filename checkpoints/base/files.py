"""Checks on the files a checkpoint is read from, and small files written durably (a crash
leaves the old file or the new one, never half of one)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import stat
from collections.abc import Iterator
from typing import BinaryIO


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


@contextlib.contextmanager
def replacing(path: pathlib.Path) -> Iterator[BinaryIO]:
    """A file to write `path`'s new content to: `<path>.tmp`, synced to disk and renamed over
    `path` when the block ends without an exception (left behind, never renamed, when it raises)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        yield f
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_durably(path: pathlib.Path, data: bytes) -> None:
    """`data` in place of `path`'s content, through `replacing`."""
    with replacing(path) as f:
        f.write(data)
