"""`qmill upload` (the client's Uploads, client/uploads.py), and the --params flags of `qmill
calibrate` / `export-odml`: a checkpoint uploaded once, its upload id.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from qmill.client import credentials
from qmill.client.service_client import ServiceClient


def add_command(sub: Any) -> None:
    """Adds `qmill upload` to the CLI's subparsers."""
    u = sub.add_parser("upload", help="store a checkpoint on a server once (prints its upload id)")
    u.add_argument("checkpoint", help="safetensors file, npz or Orbax directory")
    u.add_argument("--server", required=True, help="HOST:PORT")
    u.add_argument("--resume", default="", metavar="UPLOAD_ID", help="continue this upload")
    u.add_argument("--timeout", type=float, help="seconds before a call is abandoned")
    credentials.add_arguments(u)


def run_command(
    client: ServiceClient, args: argparse.Namespace, print_line: Callable[[str], None]
) -> int:
    """Runs `qmill upload`: prints the upload id (the last line, alone, for scripts)."""
    sent = _Counter()
    status = client.upload(args.checkpoint, upload_id=args.resume, on_sent=sent)
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


def params_upload_id(
    client: ServiceClient, args: argparse.Namespace, print_line: Callable[[str], None]
) -> str:
    """The upload id of the params named by programs.add_params_arguments' flags (uploading a
    --params checkpoint first)."""
    if args.params_upload_id:
        return args.params_upload_id
    if not os.path.exists(args.params):
        hint = f"; to name an earlier upload, pass --params-upload-id {args.params}"
        looks_like_id = len(args.params) == 32 and all(c in "0123456789abcdef" for c in args.params)
        raise FileNotFoundError(
            f"--params {args.params}: no such checkpoint{hint if looks_like_id else ''}"
        )
    sent = _Counter()
    status = client.upload(args.params, on_sent=sent)
    print_line(
        f"params {args.params}: upload {status.upload_id} ({status.total_bytes:,} bytes, "
        f"{sent.describe()})"
    )
    return status.upload_id
