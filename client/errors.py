"""One exception for everything that goes wrong talking to qmill, and the one map to it.

`mapped()` is the only place a failure of the wire becomes a QmillError: the client's connection
(connection.py) runs every call and every read of a server's stream inside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc

from qmill.checkpoints.errors import QmillError as QmillError
from qmill.proto import wire


def from_rpc_error(error: grpc.RpcError) -> QmillError:
    """The QmillError of a failed RPC: its status name and details."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    return QmillError(code.name if code is not None else "UNKNOWN", details or "")


@contextlib.contextmanager
def mapped() -> Iterator[None]:
    """Raises a failed RPC as its QmillError, and bytes from a server that break the wire
    contract (wire.WireError: a bad crc32c, a stream cut mid-tensor) as theirs."""
    try:
        yield
    except grpc.RpcError as e:
        raise from_rpc_error(e) from None
    except wire.WireError as e:
        raise QmillError(e.code, str(e)) from None
