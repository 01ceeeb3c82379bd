"""The server's domain exceptions, and the one place where exceptions become gRPC status codes.

Code that finds a condition the client can act on raises one of the `ServerError` classes below
(NotFound, AlreadyExists, FailedPrecondition, ...), with a message that says what to do; engine
and codec code raise ValueError/TypeError (INVALID_ARGUMENT); `wire.WireError` means only bytes or
headers that break the wire contract and names its own status. Those messages go to the client.
A full or read-only disk under the server (a calibration or job store that cannot be written)
is the operator's to fix: the client gets RESOURCE_EXHAUSTED or UNAVAILABLE saying so, and the
log one line with the path. Anything else is a bug: the client gets INTERNAL "internal error" and
the traceback goes to the log, never onto the wire.
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from qmill.proto import wire
from qmill.server import calls

log = logging.getLogger(__name__)

# Trailing metadata carrying how long to wait before retrying a RESOURCE_EXHAUSTED call.
RETRY_TRAILER = "retry-delay-ms"


class ServerError(Exception):
    """A condition the client can act on; `code` names its gRPC status (see status_for)."""

    code = "UNKNOWN"

    def __init_subclass__(cls, *, code: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.code = code or cls.code


class NotFound(ServerError, LookupError, code="NOT_FOUND"):
    """An unknown id or name, or one of another tenant (the same words, so ids cannot be probed).
    A LookupError too: the stores satisfy lookups documented as raising one."""


class AlreadyExists(ServerError, code="ALREADY_EXISTS"):
    """A job destination or request id that is taken."""


class FailedPrecondition(ServerError, code="FAILED_PRECONDITION"):
    """The request is fine, the state of the server or of the named data is not (yet)."""


class PermissionDenied(ServerError, code="PERMISSION_DENIED"):
    """The caller's role may not do this (admin-only operations)."""


class OutOfRange(ServerError, code="OUT_OF_RANGE"):
    """An upload chunk that is not at the committed offset, or past the announced total."""


class DataLoss(ServerError, code="DATA_LOSS"):
    """Stored content that differs from what the client announced (an upload's sha256)."""


class Unavailable(ServerError, code="UNAVAILABLE"):
    """A dependency (an object store) failed in a way a retry may fix."""


class Unimplemented(ServerError, code="UNIMPLEMENTED"):
    """This server lacks the feature: not configured, or an optional extra is not installed."""


class DeadlineExceeded(ServerError, code="DEADLINE_EXCEEDED"):
    """A client that went silent mid-tensor for longer than the server's --idle-timeout."""


class ResourceExhausted(ServerError, code="RESOURCE_EXHAUSTED"):
    """A limit was hit. With `retry_after`, the message ends with the hint and the call gets it
    in the RETRY_TRAILER trailing metadata too."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        if retry_after is not None:
            message = f"{message}; retry in {retry_after:g} s"
            # Set here so the hint reaches the client whichever layer turns this into a status.
            calls.add_trailer(RETRY_TRAILER, str(round(retry_after * 1000)))
        super().__init__(message)
        self.retry_after = retry_after


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message the client gets for `exc`."""
    if isinstance(exc, ServerError | wire.WireError):
        return grpc.StatusCode[exc.code], str(exc)
    if isinstance(exc, ValueError | TypeError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, MemoryError):
        return (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "server out of memory; retry later with fewer tensors in flight",
        )
    if isinstance(exc, OSError) and exc.errno in _DISK:
        code, what = _DISK[exc.errno]
        # The path stays in the server's log: it names the server's directories.
        return code, f"the server's disk is {what}; its operator must fix it (retry later)"
    return grpc.StatusCode.INTERNAL, "internal error"


_DISK = {
    errno.ENOSPC: (grpc.StatusCode.RESOURCE_EXHAUSTED, "full"),
    errno.EDQUOT: (grpc.StatusCode.RESOURCE_EXHAUSTED, "over its quota"),
    errno.EROFS: (grpc.StatusCode.UNAVAILABLE, "read-only"),
}


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method, exc_info=exc)
    elif isinstance(exc, OSError) and exc.errno in _DISK:
        log.error("%s failed: %s", method, exc)  # one line, with the path, for the operator
    await context.abort(code, message)


def unary(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Maps exceptions of a unary servicer method to statuses."""

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc, fn.__name__)

    return wrapper


def streaming(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    """Maps exceptions of a response-streaming servicer method to statuses."""

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            async for item in fn(self, request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await _abort(context, exc, fn.__name__)

    return wrapper
