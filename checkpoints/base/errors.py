"""The one exception of qmill's checkpoint pipeline, whoever does the quantizing.

The pipeline runs with the in-process engine, one server or several; each backend reports a
failure the same way, as a status name and a message a user can act on, so the CLI and the
server's job runner handle one type. The client raises it for every failed RPC
(`qmill.client.errors` maps gRPC status → QmillError).

OutputError is the one failure of the pipeline's own writing: a full disk, a read-only file
system or a directory the user may not write. It says what failed and what was kept for resuming,
in one line, because the CLI prints it as it is.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
from collections.abc import Callable, Iterator


class QmillError(Exception):
    """A failed call or job. `code` is the gRPC status name (e.g. "INVALID_ARGUMENT")."""

    def __init__(self, code: str, details: str, *, retry_after: float | None = None) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details
        # Seconds the server asked to wait before trying again (a limit that will free up).
        self.retry_after = retry_after


class OutputError(QmillError):
    """Writing the output failed because of where it goes (full, read-only, not writable)."""

    def __str__(self) -> str:
        return self.details  # a local failure: no status name in front of the sentence


# errno → (status name, what to fix). The disk's own failures: reading a source never raises
# these except the permission ones, which are told apart by the file they name.
_SPACE = ("RESOURCE_EXHAUSTED", "free some space")
_ACCESS = ("PERMISSION_DENIED", "choose a writable output directory (or fix its permissions)")
_OUTPUT_ERRNOS = {
    errno.ENOSPC: _SPACE,
    errno.EDQUOT: _SPACE,
    errno.EFBIG: _SPACE,
    errno.EROFS: _ACCESS,
    errno.EACCES: _ACCESS,
    errno.EPERM: _ACCESS,
}


def _is_output_failure(error: OSError, source: pathlib.Path) -> bool:
    if error.errno not in _OUTPUT_ERRNOS:
        return False
    if error.errno in (errno.EACCES, errno.EPERM):
        # A source file the user may not read is the source's problem, not the output's.
        named = error.filename
        return named is not None and not _inside(pathlib.Path(os.fsdecode(named)), source)
    return True


def _inside(path: pathlib.Path, root: pathlib.Path) -> bool:
    path, root = path.absolute(), root.absolute()
    return path == root or root in path.parents


@contextlib.contextmanager
def output_failures(
    destination: pathlib.Path,
    source: str | os.PathLike,
    partial_directory: pathlib.Path,
    finished: Callable[[], int],
) -> Iterator[None]:
    """Raises a full disk, read-only or unwritable output met inside as OutputError.

    `finished()` is how many tensors the partial output (`partial_directory`) holds when it
    happened: they are kept, and re-running the same command resumes after them.
    """
    try:
        yield
    except OSError as e:
        if not _is_output_failure(e, pathlib.Path(source)):
            raise
        code, fix = _OUTPUT_ERRNOS[e.errno]
        reason = os.strerror(e.errno).lower()
        where = f" ({os.fsdecode(e.filename)})" if e.filename is not None else ""
        count = finished()
        if count:
            plural = "tensor is" if count == 1 else "tensors are"
            kept = f"{count} finished {plural} kept in {partial_directory}/"
        else:
            kept = "no finished tensor was kept"
        raise OutputError(
            code,
            f"could not write {destination}: {reason}{where}; {kept}; {fix} and run the same "
            "command again to resume",
        ) from None
