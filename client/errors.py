"""One exception for everything that goes wrong talking to qmill, and the one map to it.

`mapped()` is the only place a failure of the wire becomes a QmillError: the client's connection
(connection.py) runs every call and every read of a server's stream inside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from qmill.checkpoints.base.errors import QmillError as QmillError
from qmill.proto import wire

if TYPE_CHECKING:
    import grpc

# Trailing metadata of a refusal that will pass: milliseconds to wait (server/errors.py sets it).
RETRY_TRAILER = "retry-delay-ms"


# What to do about a server gRPC could not reach, by what its message says (first match wins).
_UNREACHABLE_HINTS = (
    (
        "Connection refused",
        "nothing listens there: start the server (`qmill serve --port PORT`) or fix --server "
        "HOST:PORT",
    ),
    (
        "WRONG_VERSION_NUMBER",
        "the server does not use TLS: leave out --tls / --tls-ca (or start it with --tls-cert "
        "and --tls-key)",
    ),
    (
        "CERTIFICATE_VERIFY_FAILED",
        "the server's certificate is not signed by a CA this client trusts: pass the CA that "
        "signed it with --tls-ca CA.pem",
    ),
    (
        "Socket closed",
        "the server closed the connection: if it uses TLS, pass --tls-ca CA.pem (or --tls for a "
        "certificate from a public CA); under mTLS also --tls-cert and --tls-key",
    ),
    ("errors resolving", "the host name does not resolve: check --server HOST:PORT"),
    (
        "Deadline Exceeded",
        "no answer in time: check --server and that the server is up; --timeout gives it longer",
    ),
)


def _hint(code: str, details: str) -> str:
    if code != "UNAVAILABLE" and code != "DEADLINE_EXCEEDED":
        return ""
    for pattern, hint in _UNREACHABLE_HINTS:
        if pattern.lower() in details.lower():
            return f" — {hint}"
    return ""


def from_rpc_error(error: grpc.RpcError) -> QmillError:
    """The QmillError of a failed RPC: its status name, details (with what to do, for a server
    that could not be reached) and retry hint."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else str(error)
    name = code.name if code is not None else "UNKNOWN"
    details = (details or "") + _hint(name, details or "")
    return QmillError(name, details, retry_after=_retry_after(error))


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
