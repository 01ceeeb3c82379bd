"""Client side of Uploads: send a checkpoint (or bytes) once, resuming from the committed offset.

A checkpoint that is not already a safetensors file (an Orbax directory, an .npz) is sent as
safetensors bytes made one tensor at a time (upload_content), keys '/'-joined tree paths, which
is what the server reads. Uploads are named by their sha256: content the server already holds
is not sent again (StartUpload answers complete).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import grpc

from qmill.checkpoints import outcome as outcome_lib
from qmill.client import credentials, errors, streaming, upload_content
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


def upload(
    channel: grpc.Channel,
    content: upload_content.Content,
    *,
    metadata: Sequence[tuple[str, str]] | None = None,
    timeout: float | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    retries: int = 5,
    upload_id: str = "",
    on_sent: Callable[[int], None] | None = None,
) -> pb.UploadStatus:
    """Uploads ``content`` (safetensors bytes); after a failed stream, asks QueryUpload where to
    resume and goes on from there, up to ``retries`` times. Pass ``upload_id`` to resume one.

    A new upload reads the content twice (its sha256 first, which lets the server answer that
    it holds the bytes already, then the bytes); ``on_sent`` sees the size of each chunk sent.
    """
    stub = pb_grpc.UploadsStub(channel)
    try:
        if upload_id:
            status = stub.QueryUpload(
                pb.QueryUploadRequest(upload_id=upload_id), metadata=metadata, timeout=timeout
            )
        else:
            status = stub.StartUpload(
                pb.StartUploadRequest(
                    total_bytes=content.total_bytes,
                    sha256=content.sha256(),
                    format="safetensors",
                    name=content.name,
                ),
                metadata=metadata,
                timeout=timeout,
            )
    except grpc.RpcError as exc:
        raise errors.from_rpc_error(exc) from exc
    for attempt in range(retries + 1):
        if status.complete:
            return status
        try:
            return stub.Upload(
                _requests(status.upload_id, content, status.committed_bytes, chunk_bytes, on_sent),
                metadata=metadata,
                timeout=timeout,
            )
        except grpc.RpcError as exc:
            error = errors.from_rpc_error(exc)
            if error.code not in _RETRYABLE or attempt == retries:
                raise error from exc
        try:
            status = stub.QueryUpload(
                pb.QueryUploadRequest(upload_id=status.upload_id),
                metadata=metadata,
                timeout=timeout,
            )
        except grpc.RpcError as exc:
            raise errors.from_rpc_error(exc) from exc
    return status


def upload_bytes(
    channel: grpc.Channel, data: bytes, *, name: str = "", **kwargs: Any
) -> pb.UploadStatus:
    """Uploads ``data`` (safetensors bytes held in memory); see upload."""
    return upload(channel, upload_content.of_bytes(data, name), **kwargs)


def upload_file(
    channel: grpc.Channel, path: str | os.PathLike[str], **kwargs: Any
) -> pb.UploadStatus:
    """Uploads a checkpoint (safetensors file, npz or Orbax directory) as safetensors bytes,
    reading one tensor at a time; see upload."""
    with upload_content.open_checkpoint(path) as content:
        return upload(channel, content, **kwargs)


def quantize_upload(
    channel: grpc.Channel,
    recipe: Mapping[str, Any],
    upload_id: str,
    *,
    metadata: Sequence[tuple[str, str]] | None = None,
    timeout: float | None = None,
) -> Iterator[outcome_lib.TensorOutcome]:
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
        raise errors.from_rpc_error(exc) from None
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
    sent = _Counter()
    with contextlib.closing(open_channel(args.server, credentials.from_args(args))) as channel:
        status = upload_file(
            channel, args.checkpoint, timeout=args.timeout, upload_id=args.resume, on_sent=sent
        )
    print_line(
        f"{args.checkpoint}: {status.total_bytes:,} bytes ({sent.describe()}), "
        f"sha256 {status.sha256}"
    )
    print_line(status.upload_id)
    return 0


class _Counter:
    """Counts the bytes an upload sent (an ``on_sent`` callback)."""

    def __init__(self) -> None:
        self.bytes = 0

    def __call__(self, n: int) -> None:
        self.bytes += n

    def describe(self) -> str:
        return f"{self.bytes:,} sent" if self.bytes else "already on the server, none sent"


# --------------------------------------------------- params of `qmill calibrate` / `export-odml`


def add_params_arguments(parser: argparse.ArgumentParser) -> None:
    """--params CKPT | --params-upload-id ID, exactly one."""
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument(
        "--params",
        metavar="CKPT",
        help="the model's float params: a checkpoint (safetensors, npz or Orbax directory), "
        "uploaded first; content the server already holds is not sent again",
    )
    group.add_argument(
        "--params-upload-id",
        metavar="ID",
        help="the model's float params as an earlier upload (`qmill upload` prints its id)",
    )


def params_upload_id(
    channel: grpc.Channel,
    args: argparse.Namespace,
    print_line: Callable[[str], None],
    *,
    metadata: Sequence[tuple[str, str]] | None = None,
) -> str:
    """The upload id of the params named by add_params_arguments' flags (uploading a --params
    checkpoint first)."""
    if args.params_upload_id:
        return args.params_upload_id
    if not os.path.exists(args.params):
        hint = f"; to name an earlier upload, pass --params-upload-id {args.params}"
        looks_like_id = len(args.params) == 32 and all(c in "0123456789abcdef" for c in args.params)
        raise FileNotFoundError(
            f"--params {args.params}: no such checkpoint{hint if looks_like_id else ''}"
        )
    sent = _Counter()
    status = upload_file(
        channel, args.params, metadata=metadata, timeout=args.timeout, on_sent=sent
    )
    print_line(
        f"params {args.params}: upload {status.upload_id} ({status.total_bytes:,} bytes, "
        f"{sent.describe()})"
    )
    return status.upload_id
