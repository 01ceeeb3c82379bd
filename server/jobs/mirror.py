"""A copy of an object-store job's partial output in the object store, for any replica to resume.

A job whose destination is a URL writes its output, and its partial output, in the scratch
directory of the replica running it (scratch.py). When replicas share one queue (PostgreSQL)
and that replica dies, another one claims the job: to resume rather than start over, it needs
the finished tensors. So while the job runs, its partial output is copied beside the
destination, under `.NAME.qmill-partial-<job id>/` (inside the tenant's prefix, like the
upload's temporary name), at most every MIRROR_SECONDS and whenever the server hands the job
back; the runner that claims the job next downloads it before starting.

The copy keeps the partial output's rule (checkpoints/base/staging.py): a tensor is listed in
tensors.jsonl only once its parts are there. Parts are uploaded first, then the log, cut after
its last complete line. The manifest's fingerprint names the local copy of the source, whose
path and file times differ on each replica; so the copy also records the source's files and
sizes, and a resuming runner adopts the partial output (staging.write_manifest with its own
fingerprint) only when those, the recipe and the format are the same. The copy is deleted when
the job ends, however it ends.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import time
from typing import Any

from etils import epath

from qmill.checkpoints.base import staging
from qmill.server.jobs import object_store, urls

log = logging.getLogger(__name__)

# Least time between two copies of a running job's partial output (a copy rewrites the log).
MIRROR_SECONDS = 1.0
_SOURCE = "source.json"  # {relative file name: size} of the source the tensors were made from
_CHUNK = 8 * 1024 * 1024


def location(destination_url: str, job_id: str) -> str:
    """Where the copy of the job's partial output lives: beside its destination."""
    parent, _, name = destination_url.rstrip("/").rpartition("/")
    return f"{parent}/.{name}{staging.PARTIAL_SUFFIX}-{job_id}"


def remove(destination: str, job_id: str) -> None:
    """Deletes the job's copy, if its destination is a URL and there is one (never raises: a
    copy left behind costs storage, not correctness, and is replaced by a later job's)."""
    if not urls.is_url(destination):
        return
    try:
        path = epath.Path(location(destination, job_id))
        if path.is_dir():
            path.rmtree(missing_ok=True)
    except Exception as e:  # any failure: see the docstring
        log.warning("job %s: could not delete its partial output copy: %s", job_id, e)


class PartialMirror:
    """Keeps `<local destination>.qmill-partial/` copied to the object store."""

    def __init__(self, local_destination: str, destination_url: str, job_id: str) -> None:
        path = pathlib.Path(local_destination).absolute()
        self._local = path.with_name(path.name + staging.PARTIAL_SUFFIX)
        self._remote = epath.Path(location(destination_url, job_id))
        self._job_id = job_id
        self._source_files: dict[str, int] = {}
        self._sent_parts: set[str] = set()
        self._sent_log = 0  # bytes of the log the copy holds
        self._sent_manifest = False
        self._last = 0.0

    def restore(self, source: str, fingerprint: dict[str, Any]) -> int:
        """Downloads a copy another runner left, when this replica has no partial output of its
        own; returns how many finished tensors it holds (0: none, or not of this source)."""
        self._source_files = _files(pathlib.Path(source))
        if (self._local / staging.MANIFEST).exists() or not self._exists(staging.MANIFEST):
            return 0
        if json.loads((self._remote / _SOURCE).read_text()) != self._source_files:
            log.info("job %s: its partial output copy is of another source", self._job_id)
            return 0
        incoming = self._local.with_name(self._local.name + ".incoming")
        shutil.rmtree(incoming, ignore_errors=True)
        object_store.download(str(self._remote), incoming, check=lambda: None)
        found = json.loads((incoming / staging.MANIFEST).read_text())["fingerprint"]
        if any(found.get(k) != fingerprint[k] for k in ("recipe", "format")):
            shutil.rmtree(incoming, ignore_errors=True)
            return 0
        staging.write_manifest(incoming, fingerprint)
        os.rename(incoming, self._local)
        data = _complete_lines(self._local / staging.LOG)
        self._sent_log = len(data)
        self._sent_parts = {p.name for p in (self._local / staging.PARTS).iterdir()}
        self._sent_manifest = True
        return data.count(b"\n")

    def sync(self, *, force: bool = False) -> None:
        """Copies what finished since the last copy (at most every MIRROR_SECONDS unless
        `force`). A failed copy is logged, not raised: the job goes on, and the next copy
        sends what this one missed."""
        if not force and time.monotonic() - self._last < MIRROR_SECONDS:
            return
        if not (self._local / staging.MANIFEST).exists():
            return  # nothing finished yet
        self._last = time.monotonic()
        try:
            self._send()
        except (OSError, ValueError) as e:
            log.warning("job %s: could not copy its partial output: %s", self._job_id, e)

    def _send(self) -> None:
        if not self._sent_manifest:
            (self._remote / _SOURCE).write_text(json.dumps(self._source_files, sort_keys=True))
            _put(self._local / staging.MANIFEST, self._remote / staging.MANIFEST)
            self._sent_manifest = True
        data = _complete_lines(self._local / staging.LOG)
        if len(data) <= self._sent_log:
            return
        for line in data[self._sent_log :].splitlines():
            for meta in json.loads(line)["parts"].values():
                if meta["file"] not in self._sent_parts:
                    part = self._local / staging.PARTS / meta["file"]
                    _put(part, self._remote / staging.PARTS / meta["file"])
                    self._sent_parts.add(meta["file"])
        (self._remote / staging.LOG).write_bytes(data)  # last: it names only parts sent
        self._sent_log = len(data)

    def _exists(self, name: str) -> bool:
        return (self._remote / name).exists()


def _complete_lines(path: pathlib.Path) -> bytes:
    data = path.read_bytes() if path.exists() else b""
    return data[: data.rfind(b"\n") + 1]


def _files(source: pathlib.Path) -> dict[str, int]:
    if source.is_file():
        return {source.name: source.stat().st_size}
    return {
        p.relative_to(source).as_posix(): p.stat().st_size
        for p in sorted(source.rglob("*"))
        if p.is_file()
    }


def _put(local: pathlib.Path, remote: epath.Path) -> None:
    with open(local, "rb") as reader, remote.open("wb") as writer:
        shutil.copyfileobj(reader, writer, _CHUNK)
