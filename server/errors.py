"""The one place where exceptions become gRPC status codes.

Engine and codec code raise ValueError/TypeError (or WireError, which names its own code) with a
message that says what to fix; that message goes to the client. Anything else is a bug: the client
gets INTERNAL "internal error" and the traceback goes to the log, never onto the wire.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from qmill.proto import wire

log = logging.getLogger(__name__)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, wire.WireError):
        return grpc.StatusCode[exc.code], str(exc)
    if isinstance(exc, ValueError | TypeError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, MemoryError):
        return (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "server out of memory; retry later with fewer tensors in flight",
        )
    return grpc.StatusCode.INTERNAL, "internal error"


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    code, message = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method, exc_info=exc)
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
