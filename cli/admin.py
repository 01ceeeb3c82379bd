"""Client side of the Admin service: `qmill admin info` (an admin token is needed)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from qmill.client import credentials
from qmill.proto.v1 import qmill_pb2 as pb

if TYPE_CHECKING:
    from qmill.client import client as client_lib


def as_dict(info: pb.ServerInfo) -> dict[str, Any]:
    """Every field by its proto name, numbers as JSON numbers (proto JSON makes uint64 strings)."""
    out: dict[str, Any] = {}
    for field in info.DESCRIPTOR.fields:
        value = getattr(info, field.name)
        out[field.name] = dict(sorted(value.items())) if field.message_type else value
    return out


def _limit(value: int) -> str:
    return f"{value:,}" if value else "unlimited"


def describe(info: pb.ServerInfo) -> list[str]:
    """Readable lines: load against the limits, then the other limits."""
    lines = [
        f"in-flight bytes: {info.inflight_bytes:,} of {_limit(info.max_inflight_bytes)} "
        f"(peak {info.inflight_peak_bytes:,}); calls waiting for room: {info.waiting_calls}",
    ]
    per_tenant = _limit(info.max_tenant_inflight_bytes)
    for tenant, held in sorted(info.inflight_bytes_by_tenant.items()):
        lines.append(f"  tenant {tenant}: {held:,} of {per_tenant}")
    if not info.inflight_bytes_by_tenant:
        lines.append(f"  no tenant holds any (limit per tenant: {per_tenant})")
    lines += [
        f"streams: {info.active_streams} open of {_limit(info.max_concurrent_streams)}",
        f"largest tensor: {_limit(info.max_tensor_bytes)} bytes",
        f"largest upload: {_limit(info.max_upload_bytes)} bytes",
    ]
    return lines


def add_command(sub: Any) -> None:
    """Adds `qmill admin info` to the CLI's subparsers."""
    a = sub.add_parser("admin", help="server-wide operations (admin token)")
    commands = a.add_subparsers(dest="admin_command", required=True)
    i = commands.add_parser("info", help="live load and limits of a server")
    i.add_argument("--server", required=True, help="HOST:PORT")
    i.add_argument("--json", action="store_true", help="print the fields as one JSON object")
    i.add_argument("--timeout", type=float, default=30.0, help="seconds (default %(default)s)")
    credentials.add_arguments(i)


def run_command(
    client: client_lib.Client, args: argparse.Namespace, print_line: Callable[[str], None]
) -> int:
    """Runs `qmill admin info` on `client`."""
    info = client.server_info()
    if args.json:
        print_line(json.dumps(as_dict(info), sort_keys=True))
    else:
        for line in describe(info):
            print_line(line)
    return 0
