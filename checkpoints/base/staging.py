"""Atomic placement of an output, and the resumable record of an unfinished one.

StagedOutput: an output staged beside the destination, renamed into place on commit.

The staging path sits in the destination's parent directory (`.NAME.qmill-tmp-XXXXXXXX`), so the
final rename never crosses a filesystem and the destination never shows a half-written checkpoint.
A run killed before its commit leaves its staging path behind; the commit of the run that resumes
(or restarts) it deletes every such leftover of the same destination (issue 39).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import pathlib
import shutil
import uuid
from typing import Any

import google_crc32c
import numpy as np

from qmill.checkpoints.base import dtypes


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

    def _leftovers(self) -> list[pathlib.Path]:
        """Staging (and moved-aside) paths of this destination that runs killed before their
        commit left behind: whoever writes the destination now, those runs are over."""
        name = self.destination.name
        return [
            path
            for tag in ("qmill-tmp", "qmill-old")
            for path in self.destination.parent.glob(f".{glob.escape(name)}.{tag}-" + "?" * 8)
            if path != self.staging
        ]

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
        for leftover in self._leftovers():
            remove(leftover)

    def abort(self) -> None:
        """Deletes everything staged, including side files named after the staging path."""
        for path in self.staging.parent.glob(self.staging.name + "*"):
            remove(path)


def remove(path: pathlib.Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# The resumable side of an output: what a run has finished, kept until the output is committed.
PARTIAL_SUFFIX = ".qmill-partial"
MANIFEST = "manifest.json"  # fingerprints, written once (atomically) when the area is created
LOG = "tensors.jsonl"  # one JSON line per finished tensor, appended after its parts are written
PARTS = "parts"  # the finished tensors' parts, one file each, named in the log
DATA = "data"  # a writer's output data, written once in place (InPlace), moved out on commit


@dataclasses.dataclass(frozen=True)
class InPlace:
    """Where a writer that writes its output only once keeps the data of its unfinished files
    (inside the partial output, so an interrupted run's data survives), and what the log says
    an interrupted run wrote there: one note per entry, in entry order (run/in_order.py).

    A note: {"path", "call": "quantized", "parts": {part: dtype}} or {"path", "call": "source",
    "dtype", "shape"}, plus "events", the writer's own record of where the bytes went."""

    directory: pathlib.Path
    written: tuple[dict[str, Any], ...] = ()


def write_manifest(directory: pathlib.Path, fingerprint: dict[str, Any]) -> None:
    """Writes (atomically) the manifest that makes `directory` a partial output of `fingerprint`.

    Also for a partial output copied from another machine (a job resumed on another replica of a
    server, whose copy of the source has another path and file times): the caller vouches that
    it was made from the same source, recipe and format, and gives the fingerprint of its own."""
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"fingerprint": fingerprint}, sort_keys=True))
    os.replace(tmp, directory / MANIFEST)


class FingerprintMismatch(ValueError):
    """The partial output was started with another recipe, source or format."""


class PartialOutput:
    """`<destination>.qmill-partial/`: the finished tensors of an interrupted run.

    The directory's name is a function of the destination alone, so re-running the same command
    finds it. A finished tensor is kept one of two ways, and only then is one line appended to
    `tensors.jsonl` (its path and whatever the caller records):
    - written in place (`record_written`): a writer given `in_place()` wrote it straight into
      the output's data under `data/`; the line carries the writer's notes ("written") of what
      it wrote since the last line, with a crc32c per tensor. Nothing is written twice.
    - as parts (`record`): its parts go to `parts/<index>-<name>.bin` (dtype, shape and crc32c
      in the line), for a result that arrives before its turn in the output, a writer that
      cannot write in place, or an output whose write failed.
    A run killed mid-tensor leaves at most a torn last line, which is ignored, and part files or
    data past the last note that the next run overwrites: a tensor is either complete in the
    log or absent. Nothing is fsynced: resuming guards against the process dying (kill, crash,
    lost server), not the machine; after a power loss the crc32c checks on resuming catch what
    the page cache lost.
    """

    def __init__(
        self, destination: str | os.PathLike, fingerprint: dict[str, Any], *, restart: bool
    ) -> None:
        destination = pathlib.Path(destination).absolute()
        self.directory = destination.with_name(destination.name + PARTIAL_SUFFIX)
        self.fingerprint = json.loads(json.dumps(fingerprint, sort_keys=True))
        if restart:
            self.discard()
        self.completed: dict[str, dict[str, Any]] = {}
        # What the log says an interrupted run wrote in place (InPlace.written): read once, for
        # the writer this run opens; this run's own notes go to the log only.
        self.written: list[dict[str, Any]] = []
        self._log: Any = None
        if (self.directory / MANIFEST).exists():
            self._check_fingerprint()
            self.completed = self._read_log()
            self._open_log()
        else:
            remove(self.directory)  # a directory without a manifest holds nothing finished
        # Otherwise the directory is created with the first finished tensor: a run that fails
        # before one (a server never reached, a bad recipe) leaves nothing behind to clean up.

    def _open_log(self) -> None:
        self._log = open(self.directory / LOG, "a", encoding="utf-8")  # noqa: SIM115 - close()

    def _create(self) -> None:
        (self.directory / PARTS).mkdir(parents=True)
        write_manifest(self.directory, self.fingerprint)
        self._open_log()

    def _check_fingerprint(self) -> None:
        try:
            found = json.loads((self.directory / MANIFEST).read_text())["fingerprint"]
        except (OSError, ValueError, KeyError):
            found = None
        if found == self.fingerprint:
            return
        differ = sorted(
            k for k in self.fingerprint if not found or found.get(k) != self.fingerprint[k]
        )
        raise FingerprintMismatch(
            f"{self.directory} holds a partial output made with a different "
            f"{', '.join(differ) or 'manifest'}; re-run with the original arguments to resume, "
            "or pass --restart to discard the partial output"
        )

    def _read_log(self) -> dict[str, dict[str, Any]]:
        completed: dict[str, dict[str, Any]] = {}
        path = self.directory / LOG
        if not path.exists():
            return completed
        good = 0
        with open(path, "rb") as f:
            for line in f:
                try:
                    record = json.loads(line) if line.endswith(b"\n") else None
                except ValueError:
                    record = None
                if record is None:
                    break  # torn by a kill mid-append: that tensor is not finished
                completed[record["path"]] = record
                self.written.extend(record.get("written", ()))
                good += len(line)
        # Drop a torn tail so the next append starts on a line of its own.
        if path.stat().st_size != good:
            with open(path, "r+b") as f:
                f.truncate(good)
        return completed

    def in_place(self) -> InPlace:
        """Where a writer writes its data once, and what an interrupted run wrote there."""
        return InPlace(self.directory / DATA, tuple(self.written))

    def record_written(
        self, path: str, info: dict[str, Any], written: list[dict[str, Any]]
    ) -> None:
        """Marks `path` finished: it and the entries in `written` (the writer's notes since the
        last line) are in the output's data, where InPlace put them."""
        self._append({"path": path, "parts": {}, "info": info, "written": written})

    def record(
        self,
        index: int,
        path: str,
        parts: dict[str, np.ndarray | dtypes.Packed4],
        info: dict[str, Any],
    ) -> None:
        """Writes `parts` of the tensor `path` (entry number `index`), then marks it finished."""
        if self._log is None:
            self._create()
        written = {}
        files: list[pathlib.Path] = []
        try:
            for name, array in parts.items():
                file = self.directory / PARTS / f"{index:06d}-{name}.bin"
                files.append(file)
                written[name] = self._write_part(file, array)
        except BaseException:
            # A part whose write failed (a full disk) is not left behind, empty or torn, until
            # a rerun overwrites it (issue 39); nor are the parts of this tensor written before.
            for file in files:
                file.unlink(missing_ok=True)
            raise
        self._append({"path": path, "parts": written, "info": info})

    @staticmethod
    def _write_part(file: pathlib.Path, array: np.ndarray | dtypes.Packed4) -> dict[str, Any]:
        """Writes one part's bytes to `file`; returns its entry in the log line."""
        if isinstance(array, dtypes.Packed4):  # kept packed, as the checkpoint stores it
            data, meta = array.packed, {"packed": True}
        else:
            array = np.ascontiguousarray(array)
            data, meta = array.reshape(-1).view(np.uint8), {}
        with open(file, "wb") as f:
            f.write(memoryview(data))
        return {
            "file": file.name,
            "dtype": array.dtype.name,
            "shape": list(array.shape),
            # The array itself, not bytes(data): google_crc32c reads any contiguous numpy
            # array in place (not a memoryview), and the copy cost as much as the write.
            "crc32c": google_crc32c.value(data) if data.size else 0,
            **meta,
        }

    def _append(self, record: dict[str, Any]) -> None:
        if self._log is None:
            self._create()
        line = json.dumps(record, sort_keys=True)
        self._log.write(line + "\n")
        self._log.flush()
        self.completed[record["path"]] = json.loads(line)

    def load(self, path: str) -> dict[str, np.ndarray | dtypes.Packed4]:
        """The parts recorded for `path`, checked against their crc32c."""
        parts = {}
        for name, meta in self.completed[path]["parts"].items():
            data = (self.directory / PARTS / meta["file"]).read_bytes()
            if (google_crc32c.value(data) if data else 0) != meta["crc32c"]:
                raise ValueError(
                    f"{self.directory}: the saved {name} of {path} is corrupted (crc32c "
                    "mismatch); pass --restart to discard the partial output"
                )
            dtype = dtypes.logical_dtype(meta["dtype"])
            if meta.get("packed"):
                raw = np.frombuffer(data, np.uint8)
                parts[name] = dtypes.Packed4(raw, dtype, tuple(meta["shape"]))
            else:
                parts[name] = np.frombuffer(data, dtype=dtype).reshape(meta["shape"])
        return parts

    def close(self) -> None:
        if self._log is not None:
            self._log.close()

    def discard(self) -> None:
        """Deletes the partial output (after a commit, or on --restart)."""
        if getattr(self, "_log", None) is not None:
            self._log.close()
        remove(self.directory)
