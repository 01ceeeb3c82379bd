"""One exception for everything that goes wrong talking to qmill, and the one map to it."""

from __future__ import annotations

import grpc

from qmill.checkpoints.errors import QmillError as QmillError


def from_rpc_error(error: grpc.RpcError) -> QmillError:
    """The QmillError of a failed RPC: its status name and details."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    return QmillError(code.name if code is not None else "UNKNOWN", details or "")
