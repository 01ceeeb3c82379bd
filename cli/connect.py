"""The one Client of a command that talks to `--server`, with its connection flags."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from qmill.client import credentials

if TYPE_CHECKING:
    from qmill.client import client as client_lib


def client(args: argparse.Namespace) -> client_lib.Client:
    """A Client of `args.server`, with the command's connection flags (the gRPC client is
    imported here, on use)."""
    from qmill.client import client as client_lib  # lazy: see add_command

    return client_lib.Client(
        args.server,
        credentials=credentials.from_args(args),
        timeout=getattr(args, "timeout", None),
    )
