"""Client side of Uploads: send a file (or bytes) once, resuming from the committed offset.

A checkpoint that is not already a safetensors file (an Orbax directory, an .npz) is converted
to safetensors bytes first, keys '/'-joined tree paths, which is what the server reads.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import pathlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import grpc
import numpy as np
import safetensors.numpy

from qmill.client import credentials, errors, streaming
from qmill.proto import recipe as recipe_proto
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc

CHUNK_BYTES = 1024 * 1024
# Responses carry chunks of up to 4 MiB plus framing: twice that, as the remote client allows.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 2 * wire.MAX_CHUNK_BYTES),
    ("grpc.max_send_message_length", 2 * wire.MAX_CHUNK_BYTES),
]
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


def quantize_upload(
    channel: grpc.Channel,
    recipe: Mapping[str, Any],
    upload_id: str,
    *,
    metadata: Sequence[tuple[str, str]] | None = None,
    timeout: float | None = None,
) -> Iterator[streaming.TensorOutcome]:
    """QuantizeParams on a completed upload: the server reads the tensors, nothing is streamed up.

    Kept tensors come back without an array (the caller has the file it uploaded).
    """
    requests = [
        pb.QuantizeParamsRequest(recipe=recipe_proto.from_mapping(recipe)),
        pb.QuantizeParamsRequest(upload_id=upload_id),
    ]
    decoder = streaming.ResponseDecoder({})
    call = pb_grpc.QuantizerStub(channel).QuantizeParams(
        iter(requests), metadata=metadata, timeout=timeout
    )
    try:
        for response in call:
            outcome = decoder.feed(response)
            if outcome is not None:
                yield outcome
        decoder.check_finished()
    except grpc.RpcError as exc:
        raise errors.QmillError.from_rpc_error(exc) from None
    except wire.WireError as exc:
        raise errors.QmillError(exc.code, str(exc)) from None
    finally:
        call.cancel()


def open_channel(server: str, creds: credentials.Credentials) -> grpc.Channel:
    """A channel to ``server`` for uploads, calibration and export (token and TLS from creds)."""
    return credentials.channel(server, creds, CHANNEL_OPTIONS)


def add_command(sub: Any) -> None:
    """Adds `qmill upload` to the CLI's subparsers."""
    u = sub.add_parser("upload", help="store a checkpoint on a server once (prints its upload id)")
    u.add_argument("checkpoint", help="safetensors file, npz or Orbax directory")
    u.add_argument("--server", required=True, help="HOST:PORT")
    u.add_argument("--resume", default="", metavar="UPLOAD_ID", help="continue this upload")
    u.add_argument("--timeout", type=float, help="seconds before a call is abandoned")
    credentials.add_arguments(u)


def run_command(args: argparse.Namespace, print_line: Callable[[str], None]) -> int:
    """Runs `qmill upload`: prints the upload id (the last line, alone, for scripts)."""
    with contextlib.closing(open_channel(args.server, credentials.from_args(args))) as channel:
        status = upload_file(channel, args.checkpoint, timeout=args.timeout, upload_id=args.resume)
    print_line(f"{args.checkpoint}: {status.total_bytes:,} bytes, sha256 {status.sha256}")
    print_line(status.upload_id)
    return 0
