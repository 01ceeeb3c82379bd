"""Resumable, content-addressed uploads kept on the server's disk.

Layout under ``root``:
  uploads/<id>.json   the record of one upload (tenant, sizes, committed offset, expiry, sha256)
  uploads/<id>.part   the bytes received so far (only while incomplete)
  blobs/<sha256>      finished content; identical bytes uploaded twice are stored once

Durability order: a chunk's bytes are written and fsynced before the record's committed offset
moves past them (the record is replaced atomically), so after a crash or a failed write the part
file is truncated back to the committed offset and the upload resumes from there. A failed write
(ENOSPC, quota) raises RESOURCE_EXHAUSTED and leaves the upload exactly as it was.

Ids are random and tenant-scoped: another tenant's id answers NOT_FOUND, like an unknown one.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import pathlib
import secrets
import threading
import time
from typing import Any

import jax
import numpy as np
from jax import numpy as jnp

from qmill.checkpoints.formats.safetensors import header as safetensors_header
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import errors, params

FORMATS = ("safetensors",)
_HASH_BLOCK = 8 * 1024 * 1024


@dataclasses.dataclass(kw_only=True)
class _Record:
    id: str
    tenant: str
    total_bytes: int
    committed_bytes: int = 0
    # Given by the client at start (checked at the end), or computed once complete.
    expected_sha256: str = ""
    sha256: str = ""
    complete: bool = False
    name: str = ""
    format: str = "safetensors"
    expires_unix: float = 0.0

    def status(self) -> pb.UploadStatus:
        same = ("committed_bytes", "total_bytes", "complete", "sha256", "expires_unix")
        return pb.UploadStatus(upload_id=self.id, **{name: getattr(self, name) for name in same})


class UploadStore:
    """Uploads of all tenants under one directory. Thread-safe; blocking (run off the loop)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_upload_bytes: int,
        quota_bytes: int,
        expiry_seconds: float,
        clock: Any = time.time,
    ) -> None:
        self.root = pathlib.Path(root)
        self._uploads = self.root / "uploads"
        self._blobs = self.root / "blobs"
        self.max_upload_bytes = max_upload_bytes
        # Per tenant: the total size of its live uploads (a shared blob counts for each).
        self.quota_bytes = quota_bytes
        self.expiry_seconds = expiry_seconds
        self._clock = clock
        self._lock = threading.RLock()

    # ---------------------------------------------------------------------------- records

    def _meta(self, upload_id: str) -> pathlib.Path:
        return self._uploads / f"{upload_id}.json"

    def _part(self, upload_id: str) -> pathlib.Path:
        return self._uploads / f"{upload_id}.part"

    def blob_path(self, sha256: str) -> pathlib.Path:
        return self._blobs / sha256

    def _save(self, rec: _Record) -> None:
        tmp = self._meta(rec.id).with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(dataclasses.asdict(rec), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._meta(rec.id))

    def _records(self) -> list[_Record]:
        out = []
        for path in self._uploads.glob("*.json"):
            try:
                out.append(_Record(**json.loads(path.read_text())))
            except (OSError, ValueError, TypeError):
                continue  # removed meanwhile, or a torn file from before a crash
        return out

    def _get(self, tenant: str, upload_id: str) -> _Record:
        # Ids are hex tokens; anything else cannot name a file here.
        ok = upload_id and all(c in "0123456789abcdef" for c in upload_id)
        path = self._meta(upload_id) if ok else None
        if path is None or not path.exists():
            raise errors.NotFound(f"upload {upload_id!r} not found (unknown or expired)")
        rec = _Record(**json.loads(path.read_text()))
        if rec.tenant != tenant or rec.expires_unix < self._clock():
            raise errors.NotFound(f"upload {upload_id!r} not found (unknown or expired)")
        return rec

    # ---------------------------------------------------------------------------- the RPCs

    def start(
        self, tenant: str, *, total_bytes: int, sha256: str = "", fmt: str = "", name: str = ""
    ) -> pb.UploadStatus:
        fmt = fmt or "safetensors"
        if fmt not in FORMATS:
            raise ValueError(f"format {fmt!r} is not supported; use one of {list(FORMATS)}")
        sha256 = sha256.lower()
        if sha256 and (len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256)):
            raise ValueError(f"sha256 must be 64 hex digits, got {sha256!r}")
        if total_bytes <= 0:
            raise ValueError("total_bytes must be positive")
        if total_bytes > self.max_upload_bytes:
            raise errors.ResourceExhausted(
                f"upload of {total_bytes} bytes is over this server's limit of "
                f"{self.max_upload_bytes} (--max-upload-bytes)",
            )
        with self._lock:
            # Created on first use: a server that never sees an upload leaves no directories.
            self._uploads.mkdir(parents=True, exist_ok=True)
            self._blobs.mkdir(parents=True, exist_ok=True)
            self.sweep()
            used = sum(r.total_bytes for r in self._records() if r.tenant == tenant)
            if used + total_bytes > self.quota_bytes:
                raise errors.ResourceExhausted(
                    f"upload quota exceeded: tenant {tenant!r} holds {used} of "
                    f"{self.quota_bytes} bytes and this upload needs {total_bytes}; wait for "
                    "old uploads to expire or ask for a larger --upload-quota-bytes",
                )
            rec = _Record(
                id=secrets.token_hex(16),
                tenant=tenant,
                total_bytes=total_bytes,
                expected_sha256=sha256,
                name=name,
                format=fmt,
                expires_unix=self._clock() + self.expiry_seconds,
            )
            blob = self.blob_path(sha256) if sha256 else None
            if blob is not None and blob.exists() and blob.stat().st_size == total_bytes:
                # Already held: nothing to send.
                rec.committed_bytes, rec.complete, rec.sha256 = total_bytes, True, sha256
            self._save(rec)
            return rec.status()

    def query(self, tenant: str, upload_id: str) -> pb.UploadStatus:
        with self._lock:
            return self._get(tenant, upload_id).status()

    def append(
        self, tenant: str, upload_id: str, offset: int, data: bytes, crc32c: int
    ) -> pb.UploadStatus:
        """Appends one chunk at the committed offset; completes the upload with its last byte."""
        if len(data) > wire.MAX_CHUNK_BYTES:
            raise ValueError(f"chunk of {len(data)} bytes; at most {wire.MAX_CHUNK_BYTES}")
        if wire.crc32c(data) != crc32c:
            raise wire.WireError(
                f"upload {upload_id}: crc32c mismatch for the chunk at offset {offset}; "
                "nothing of it was kept, send it again",
                code="DATA_LOSS",
            )
        with self._lock:
            rec = self._get(tenant, upload_id)
            if offset != rec.committed_bytes:
                raise errors.OutOfRange(
                    f"upload {upload_id}: offset {offset} is not the committed offset "
                    f"{rec.committed_bytes}; resume from {rec.committed_bytes}",
                )
            if offset + len(data) > rec.total_bytes:
                raise errors.OutOfRange(
                    f"upload {upload_id}: {offset + len(data)} bytes is past the announced "
                    f"total of {rec.total_bytes}",
                )
            if data:
                self._write(rec, data)
                rec.committed_bytes += len(data)
                rec.expires_unix = self._clock() + self.expiry_seconds
                if rec.committed_bytes == rec.total_bytes:
                    self._finish(rec)
                self._save(rec)
            return rec.status()

    def _write(self, rec: _Record, data: bytes) -> None:
        fd = os.open(self._part(rec.id), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            # Drop bytes past the committed offset (a write that failed half way, a crash).
            os.ftruncate(fd, rec.committed_bytes)
            os.lseek(fd, rec.committed_bytes, os.SEEK_SET)
            try:
                view = memoryview(data)
                while view:
                    view = view[self._os_write(fd, view) :]
                os.fsync(fd)
            except OSError as exc:
                os.ftruncate(fd, rec.committed_bytes)
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise errors.ResourceExhausted(
                        f"server disk full while storing upload {rec.id}; committed offset "
                        f"stays {rec.committed_bytes}: retry later from there",
                    ) from exc
                raise
        finally:
            os.close(fd)

    # A seam for tests (a full disk); os.write itself otherwise.
    _os_write = staticmethod(os.write)

    def _finish(self, rec: _Record) -> None:
        part = self._part(rec.id)
        digest = hashlib.sha256()
        with open(part, "rb") as f:
            while block := f.read(_HASH_BLOCK):
                digest.update(block)
        sha = digest.hexdigest()
        if rec.expected_sha256 and sha != rec.expected_sha256:
            part.unlink(missing_ok=True)
            rec.committed_bytes = 0
            self._save(rec)
            raise errors.DataLoss(
                f"upload {rec.id}: content sha256 {sha} differs from the announced "
                f"{rec.expected_sha256}; the bytes were dropped, upload again from offset 0",
            )
        blob = self.blob_path(sha)
        if blob.exists():
            part.unlink()  # the same bytes are already stored
        else:
            os.replace(part, blob)
        rec.sha256, rec.complete = sha, True

    # ---------------------------------------------------------------------------- upkeep

    def sweep(self) -> int:
        """Deletes expired uploads and the blobs no live upload names; returns uploads removed."""
        now = self._clock()
        removed = 0
        with self._lock:
            live = set()
            for rec in self._records():
                if rec.expires_unix < now:
                    self._part(rec.id).unlink(missing_ok=True)
                    self._meta(rec.id).unlink(missing_ok=True)
                    removed += 1
                elif rec.sha256:
                    live.add(rec.sha256)
            for blob in self._blobs.iterdir() if self._blobs.exists() else ():
                if blob.name not in live:
                    blob.unlink(missing_ok=True)
        return removed

    # ---------------------------------------------------------------------------- reading

    def content_path(self, tenant: str, upload_id: str) -> pathlib.Path:
        """The finished content; FAILED_PRECONDITION while the upload is incomplete."""
        with self._lock:
            rec = self._get(tenant, upload_id)
            if not rec.complete:
                raise errors.FailedPrecondition(
                    f"upload {upload_id} is incomplete ({rec.committed_bytes} of "
                    f"{rec.total_bytes} bytes); finish it first",
                )
            return self.blob_path(rec.sha256)

    def open_params(self, tenant: str, upload_id: str) -> dict[str, Any]:
        """The uploaded safetensors file as a nested dict of jax arrays (keys split at '/')."""
        path = self.content_path(tenant, upload_id)
        flat = {t.path: t.read() for t in safetensors_index(path, f"upload {upload_id}")}
        return jax.tree.map(jnp.asarray, params.unflatten(flat))

    def tensors(self, tenant: str, upload_id: str) -> list[StoredTensor]:
        """The upload's tensors in file order, unread (QuantizeParams reads one at a time)."""
        return safetensors_index(self.content_path(tenant, upload_id), f"upload {upload_id}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoredTensor:
    """One tensor of a stored safetensors file: where its bytes are, read on demand."""

    path: str
    dtype: np.dtype
    shape: tuple[int, ...]
    file: pathlib.Path
    # Byte range of the data in ``file``.
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def read(self) -> np.ndarray:
        with open(self.file, "rb") as f:
            f.seek(self.start)
            raw = f.read(self.nbytes)
        if len(raw) != self.nbytes:
            raise ValueError(f"tensor {self.path!r}: the stored file is truncated")
        return np.frombuffer(raw, dtype=self.dtype).reshape(self.shape)


def safetensors_index(path: pathlib.Path, name: str) -> list[StoredTensor]:
    """The tensors of a safetensors file in file order, header only, read by the one parser and
    dtype table of qmill.checkpoints. A malformed file is a ValueError that calls it `name`: the
    message goes to the client, who has no business with the server's paths."""
    try:
        header, _, base = safetensors_header.read_header(path)
        out = []
        for key, info in header.items():
            shape = tuple(int(d) for d in info["shape"])
            if any(d < 0 for d in shape):
                raise ValueError(f"{path}: tensor {key} has a negative dimension in {list(shape)}")
            start, end = (base + int(v) for v in info["data_offsets"])
            dtype = safetensors_header.CODES[info["dtype"]]
            out.append(
                StoredTensor(path=key, dtype=dtype, shape=shape, file=path, start=start, end=end)
            )
    except (ValueError, TypeError) as exc:
        raise ValueError(str(exc).replace(str(path), name)) from None
    return out
