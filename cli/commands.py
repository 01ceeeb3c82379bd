"""The `qmill` commands a client runs: quantize (quantize.py), inspect (listing.py), capabilities
(here), and upload, calibrate, export-odml, export-program, submit / jobs and admin (their
modules).

The `qmill` dispatcher (main.py) parses their flags with parsers.py and runs them here; `serve`
is the server's (qmill.server.command). The gRPC client is imported only by the commands that
talk to a server.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rich.console import Console

from qmill.checkpoints.base import errors as checkpoint_errors
from qmill.cli import connect, listing, quantize

if TYPE_CHECKING:
    from qmill.client import client as client_lib

# Raised for what a user can fix: printed in one line, exit status 1.
USER_ERRORS = (
    checkpoint_errors.QmillError,
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
)


def user_message(error: Exception, args: argparse.Namespace) -> str:
    """The line printed for a user error. A run without --server has no RPC: its message speaks
    of the input, not of a gRPC status (the status name stays where a server answered)."""
    if isinstance(error, checkpoint_errors.QmillError) and not getattr(args, "server", None):
        return error.details
    return str(error)


def _capabilities(client: client_lib.Client, out: Console) -> int:
    caps = client.capabilities()
    device = caps.device_kind
    if caps.device_description.lower() not in ("", device.lower()):  # not "on cpu: cpu"
        device += f": {caps.device_description}"
    out.print(f"qmill {caps.qmill_version} (jax {caps.jax_version}) on {device}")
    out.print("qtypes: " + ", ".join(caps.qtypes))
    out.print("calibration methods: " + ", ".join(caps.calibration_methods))
    out.print(f"max tensor bytes: {caps.max_tensor_bytes:,}")
    for m in caps.models:  # for `qmill calibrate --model NAME --config '{...}'`
        fields = ", ".join(f"{f.name}: {f.type} = {f.default_json}" for f in m.config_fields)
        out.print(f"model {m.name} ({m.origin}): {m.description} {{{fields}}}", markup=False)
    return 0


def run(args: argparse.Namespace, out: Console | None = None, err: Console | None = None) -> int:
    """Runs the client command `args.command` (printing to `out` and `err`, stdout and stderr by
    default); returns the exit status."""
    out = out or Console()
    err = err or Console(stderr=True)

    def line(text: str) -> None:
        out.print(text, markup=False, highlight=False, soft_wrap=True)

    if args.command == "quantize":
        return quantize.run(args, out, err)
    if args.command == "inspect":
        return listing.run(args, out)
    # The gRPC client's commands (and export-program's model loading): imported on use.
    from qmill.cli import admin, calibrate, export_odml, jobs, programs, uploads

    if args.command == "export-program":
        return programs.run_local(args, line)
    if args.command == "calibrate" and not args.server:
        return calibrate.run_local(args, line)
    modules = {
        "export-odml": export_odml,
        "admin": admin,
        "upload": uploads,
        "calibrate": calibrate,
        "submit": jobs,
        "jobs": jobs,
    }
    with connect.client(args) as client:
        if args.command == "capabilities":
            return _capabilities(client, out)
        return modules[args.command].run_command(client, args, line)
