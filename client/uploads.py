"""Client side of Uploads: send a checkpoint (or bytes) once, resuming from the committed offset.

A checkpoint that is not already a safetensors file (an Orbax directory, an .npz) is sent as
safetensors bytes made one tensor at a time (upload_content), keys '/'-joined tree paths, which
is what the server reads. Uploads are named by their sha256: content the server already holds
is not sent again (StartUpload answers complete).

The `qmill upload` command and the --params flags of `qmill calibrate` / `export-odml` are
qmill.cli.uploads'.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from qmill.client import connection, errors, upload_content
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb

CHUNK_BYTES = 1024 * 1024
# Status codes after which resuming from QueryUpload's offset can succeed.
_RETRYABLE = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "OUT_OF_RANGE", "CANCELLED", "ABORTED"})
# What Client.upload takes: a checkpoint's path, bytes held in memory, or a Content.
Source = str | os.PathLike[str] | bytes | upload_content.Content


@contextlib.contextmanager
def conversation_of(
    source: Source, name: str = "", **options: Any
) -> Iterator[connection.Conversation[pb.UploadStatus]]:
    """The conversation uploading `source`: bytes as they are (safetensors bytes, labelled
    `name`), a checkpoint (safetensors file, npz or Orbax directory) as safetensors bytes read
    one tensor at a time while the context lasts. `options`: those of `conversation`."""
    if isinstance(source, upload_content.Content):
        yield conversation(source, **options)
    elif isinstance(source, bytes):
        yield conversation(upload_content.of_bytes(source, name), **options)
    else:
        with upload_content.open_checkpoint(source) as content:
            yield conversation(content, **options)


def _requests(
    upload_id: str,
    content: upload_content.Content,
    offset: int,
    size: int,
    on_sent: Callable[[int], None] | None,
) -> Iterator[pb.UploadRequest]:
    for start, piece in content.chunks(offset, size):
        yield pb.UploadRequest(
            upload_id=upload_id, offset=start, data=piece, crc32c=wire.crc32c(piece)
        )
        if on_sent is not None:
            on_sent(len(piece))


def conversation(
    content: upload_content.Content,
    *,
    upload_id: str = "",
    chunk_bytes: int = CHUNK_BYTES,
    retries: int = 5,
    on_sent: Callable[[int], None] | None = None,
) -> connection.Conversation[pb.UploadStatus]:
    """The calls of one upload (run by Connection.drive): start it (or look up ``upload_id`` to
    resume one), send the bytes, and after a failed stream ask QueryUpload where to resume and go
    on from there, up to ``retries`` times.

    A new upload reads the content twice (its sha256 first, which lets the server answer that
    it holds the bytes already, then the bytes); ``on_sent`` sees the size of each chunk sent.
    """
    if upload_id:
        status = yield ("Uploads", "QueryUpload", pb.QueryUploadRequest(upload_id=upload_id))
    else:
        start = pb.StartUploadRequest(
            total_bytes=content.total_bytes,
            sha256=content.sha256(),
            format="safetensors",
            name=content.name,
        )
        status = yield ("Uploads", "StartUpload", start)
    for attempt in range(retries + 1):
        if status.complete:
            return status
        chunks = _requests(status.upload_id, content, status.committed_bytes, chunk_bytes, on_sent)
        try:
            return (yield ("Uploads", "Upload", chunks))
        except errors.QmillError as e:
            if e.code not in _RETRYABLE or attempt == retries:
                raise
        query = pb.QueryUploadRequest(upload_id=status.upload_id)
        status = yield ("Uploads", "QueryUpload", query)
    return status


def quantize_requests(recipe: pb.Recipe, upload_id: str) -> Iterator[pb.QuantizeParamsRequest]:
    """QuantizeParams on a completed upload: the server reads the tensors, none is streamed."""
    yield pb.QuantizeParamsRequest(recipe=recipe)
    yield pb.QuantizeParamsRequest(upload_id=upload_id)
