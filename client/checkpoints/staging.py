"""Atomic placement of an output: staged beside the destination, renamed into place on commit.

The staging path sits in the destination's parent directory (`.NAME.qmill-tmp-XXXXXXXX`), so the
final rename never crosses a filesystem and the destination never shows a half-written checkpoint.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import uuid


class StagedOutput:
    """A staging path (file or directory, the writer decides) that becomes `destination`."""

    def __init__(self, destination: str | os.PathLike, *, overwrite: bool) -> None:
        # Absolute: Orbax refuses relative paths, and a later chdir must not move the output.
        self.destination = pathlib.Path(destination).absolute()
        self.overwrite = overwrite
        if not self.destination.name:
            raise ValueError(f"{destination!r} names no file or directory to write")
        self._refuse_existing()
        self.destination.parent.mkdir(parents=True, exist_ok=True)
        self.staging = self._sibling("qmill-tmp")

    def _sibling(self, tag: str) -> pathlib.Path:
        return self.destination.with_name(f".{self.destination.name}.{tag}-{uuid.uuid4().hex[:8]}")

    def _refuse_existing(self) -> None:
        if not self.overwrite and (self.destination.exists() or self.destination.is_symlink()):
            raise FileExistsError(
                f"{self.destination} already exists; pass overwrite=True (--overwrite) to "
                "replace it"
            )

    def commit(self) -> None:
        """Moves the staged output into place. An old destination is first moved aside and
        deleted only after the new one is in place."""
        self._refuse_existing()  # it may have appeared while we were writing
        old = None
        if self.destination.exists() or self.destination.is_symlink():
            old = self._sibling("qmill-old")
            os.rename(self.destination, old)
        os.rename(self.staging, self.destination)
        if old is not None:
            remove(old)

    def abort(self) -> None:
        """Deletes everything staged, including side files named after the staging path."""
        for path in self.staging.parent.glob(self.staging.name + "*"):
            remove(path)


def remove(path: pathlib.Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
