"""Client side of Uploads: send a file (or bytes) once, resuming from the committed offset.

A checkpoint that is not already a safetensors file (an Orbax directory, an .npz) is converted
to safetensors bytes first, keys '/'-joined tree paths, which is what the server reads.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
from collections.abc import Iterator, Sequence

import grpc
import numpy as np
import safetensors.numpy

from qmill.client import errors
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc

CHUNK_BYTES = 1024 * 1024
# Status codes after which resuming from QueryUpload's offset can succeed.
_RETRYABLE = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "OUT_OF_RANGE", "CANCELLED", "ABORTED"})


def checkpoint_bytes(path: str | os.PathLike[str]) -> bytes:
    """The safetensors bytes of a checkpoint: the file itself, or a conversion of npz / Orbax."""
    p = pathlib.Path(path)
    if p.is_file() and p.suffix == ".safetensors":
        return p.read_bytes()
    from qmill.client.checkpoints import formats  # lazy: Orbax readers import jax

    with formats.open_source(p) as source:
        tensors = {e.path: np.asarray(source.read(e.path)) for e in source.entries()}
    return safetensors.numpy.save(tensors)


def _requests(upload_id: str, data: bytes, offset: int, size: int) -> Iterator[pb.UploadRequest]:
    for start in range(offset, len(data), size):
        piece = data[start : start + size]
        yield pb.UploadRequest(
            upload_id=upload_id, offset=start, data=piece, crc32c=wire.crc32c(piece)
        )


def upload_bytes(
    channel: grpc.Channel,
    data: bytes,
    *,
    name: str = "",
    metadata: Sequence[tuple[str, str]] | None = None,
    timeout: float | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    retries: int = 5,
    upload_id: str = "",
) -> pb.UploadStatus:
    """Uploads ``data`` (safetensors bytes); after a failed stream, asks QueryUpload where to
    resume and goes on from there, up to ``retries`` times. Pass ``upload_id`` to resume one."""
    stub = pb_grpc.UploadsStub(channel)
    try:
        if upload_id:
            status = stub.QueryUpload(
                pb.QueryUploadRequest(upload_id=upload_id), metadata=metadata, timeout=timeout
            )
        else:
            status = stub.StartUpload(
                pb.StartUploadRequest(
                    total_bytes=len(data),
                    sha256=hashlib.sha256(data).hexdigest(),
                    format="safetensors",
                    name=name,
                ),
                metadata=metadata,
                timeout=timeout,
            )
    except grpc.RpcError as exc:
        raise errors.QmillError.from_rpc_error(exc) from exc
    for attempt in range(retries + 1):
        if status.complete:
            return status
        try:
            return stub.Upload(
                _requests(status.upload_id, data, status.committed_bytes, chunk_bytes),
                metadata=metadata,
                timeout=timeout,
            )
        except grpc.RpcError as exc:
            error = errors.QmillError.from_rpc_error(exc)
            if error.code not in _RETRYABLE or attempt == retries:
                raise error from exc
        try:
            status = stub.QueryUpload(
                pb.QueryUploadRequest(upload_id=status.upload_id),
                metadata=metadata,
                timeout=timeout,
            )
        except grpc.RpcError as exc:
            raise errors.QmillError.from_rpc_error(exc) from exc
    return status


def upload_file(
    channel: grpc.Channel, path: str | os.PathLike[str], **kwargs: object
) -> pb.UploadStatus:
    """Uploads a checkpoint (safetensors file, npz or Orbax directory) as safetensors bytes."""
    return upload_bytes(channel, checkpoint_bytes(path), name=pathlib.Path(path).name, **kwargs)
