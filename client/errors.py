"""One exception for everything that goes wrong talking to qmill, and the one map to it.

`mapped()` is the only place a failure of the wire becomes a QmillError: the client's connection
(connection.py) runs every call and every read of a server's stream inside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from qmill.checkpoints.errors import QmillError as QmillError
from qmill.proto import wire

if TYPE_CHECKING:
    import grpc

# Trailing metadata of a refusal that will pass: milliseconds to wait (server/errors.py sets it).
RETRY_TRAILER = "retry-delay-ms"


def from_rpc_error(error: grpc.RpcError) -> QmillError:
    """The QmillError of a failed RPC: its status name, details and retry hint."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    return QmillError(
        code.name if code is not None else "UNKNOWN", details or "", retry_after=_retry_after(error)
    )


def _retry_after(error: grpc.RpcError) -> float | None:
    trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == RETRY_TRAILER:
            try:
                return max(0.0, int(value) / 1000)
            except ValueError:
                return None
    return None


@contextlib.contextmanager
def mapped() -> Iterator[None]:
    """Raises a failed RPC as its QmillError, and bytes from a server that break the wire
    contract (wire.WireError: a bad crc32c, a stream cut mid-tensor) as theirs."""
    # Here, not at the top: retry (and so every command) imports this module, and an in-process
    # quantize, which never makes an RPC, need not load gRPC (~40 ms).
    import grpc

    try:
        yield
    except grpc.RpcError as e:
        raise from_rpc_error(e) from None
    except wire.WireError as e:
        raise QmillError(e.code, str(e)) from None
