"""Per-call plumbing shared by the server's interceptors: wrapping any method handler, and the
record of the call in progress.

Every interceptor here works on the handler of whatever RPC arrives (generic, never per method):
`wrap_handler` returns a handler of the same kind whose behaviour runs the original inside an async
context manager the interceptor supplies. The call's `CallContext` (request id, trailing metadata,
the status it ended with) is reachable from anywhere the call runs through `current()`, a context
variable: grpc.aio runs each RPC in its own task, and tasks started by the handler copy it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import time
from collections.abc import Callable
from typing import Any

import grpc

# An interceptor's per-call hook: entered before the handler runs, exited after it ends (normally,
# by an exception, or by cancellation). It may abort the call by awaiting context.abort(), and may
# yield a context object to hand to the handler instead of the one it got (None keeps it).
Around = Callable[[str, Any], contextlib.AbstractAsyncContextManager[Any]]

_current: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar(
    "qmill_call", default=None
)


class CallContext:
    """Wraps the servicer context of one call: records how it ended and keeps trailing metadata
    additive (set_trailing_metadata replaces in grpc, which would drop the request id)."""

    def __init__(self, inner: Any, method: str, request_id: str) -> None:
        self._inner = inner
        self.method = method
        self.request_id = request_id
        self.code: grpc.StatusCode | None = None
        self.details = ""
        # Extra key=value fields for the call's log line (tensors, bytes, job ids ...).
        self.fields: dict[str, object] = {}
        self._trailers: dict[str, str] = {"x-request-id": request_id}
        inner.set_trailing_metadata(tuple(self._trailers.items()))
        # Read now, not when the call has ended: after a client cancels, grpc frees the call's
        # state and asking the context for its peer then can crash the process.
        self._peer = inner.peer()
        remaining = inner.time_remaining()
        self._deadline = None if remaining is None else time.monotonic() + remaining

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    def add_trailer(self, key: str, value: str) -> None:
        self._trailers[key] = value
        self._inner.set_trailing_metadata(tuple(self._trailers.items()))

    def set_trailing_metadata(self, metadata: Any) -> None:
        for key, value in metadata:
            self._trailers[key] = value
        self._inner.set_trailing_metadata(tuple(self._trailers.items()))

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        self.code, self.details = code, details
        for key, value in trailing_metadata:
            self._trailers[key] = value
        # An empty tuple makes grpc send the trailers set above.
        self._inner.set_trailing_metadata(tuple(self._trailers.items()))
        try:
            await self._inner.abort(code, details)
        except grpc.aio.InternalError as e:
            # The status could not be sent: the client is gone. A client killed mid-upload can
            # end its request stream (here: mid-tensor, DATA_LOSS) before grpc marks the call
            # cancelled; as with a failed write (_write), the call ends CANCELLED, not UNKNOWN.
            self.code, self.details = None, ""
            raise asyncio.CancelledError(f"the client went away before the status ({e})") from e

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code
        self._inner.set_code(code)

    def set_details(self, details: str) -> None:
        self.details = details
        self._inner.set_details(details)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def current() -> CallContext | None:
    """The call this code runs for, or None outside an RPC (background jobs, tests)."""
    return _current.get()


def bind(call: CallContext) -> None:
    # Never reset: the variable lives in the call's own task context, which ends with the call.
    _current.set(call)


def annotate(**fields: object) -> None:
    """Adds fields to the current call's log line; a no-op outside a call."""
    call = current()
    if call is not None:
        call.fields.update(fields)


def add_trailer(key: str, value: str) -> None:
    """Adds trailing metadata to the current call (e.g. a retry hint); a no-op outside a call."""
    call = current()
    if call is not None:
        call.add_trailer(key, value)


def wrap_handler(
    handler: grpc.RpcMethodHandler,
    method: str,
    around: Around,
    *,
    on_request_bytes: Callable[[int], None] | None = None,
    on_response_bytes: Callable[[int], None] | None = None,
) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` whose behaviour runs inside `around(method, ctx)`.

    on_request_bytes/on_response_bytes see the wire size of every message (for byte counters):
    taken where grpc (de)serializes it, because a message's ByteSize() would encode a 4 MiB
    chunk again just to measure it (it was ~12 % of the server's time on a quantize stream).
    """
    if handler.request_streaming and handler.response_streaming:
        fn, make = handler.stream_stream, grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        fn, make = handler.stream_unary, grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        fn, make = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    else:
        fn, make = handler.unary_unary, grpc.unary_unary_rpc_method_handler

    streaming_requests = handler.request_streaming
    # Every interceptor wraps the handler; only the first (innermost) guards decoding and checks
    # requests, so a streamed message is not re-checked by an async generator per interceptor.
    checks = not getattr(handler.request_deserializer, "qmill_guarded", False)

    if inspect.isasyncgenfunction(fn):
        # The first wrapper writes the responses itself (context.write) instead of yielding them
        # to grpc, so that a write to a peer that is gone ends here (_write); the wrappers
        # around it then see a coroutine handler.

        async def behavior(request, context):
            async with around(method, context) as replaced:
                if checks:
                    request = await _decoded(request, streaming_requests, context)
                responses = fn(request, replaced or context)
                try:
                    async for response in responses:
                        await _write(context, response)
                except Exception as e:
                    # A client killed mid-upload can surface as any error of the request
                    # stream's read; once the call is cancelled that is the cancellation's doing.
                    if context.cancelled():
                        raise asyncio.CancelledError(f"the client went away ({e!r})") from e
                    raise
                finally:
                    await responses.aclose()

    elif inspect.iscoroutinefunction(fn):

        async def behavior(request, context):
            async with around(method, context) as replaced:
                if checks:
                    request = await _decoded(request, streaming_requests, context)
                return await fn(request, replaced or context)

    else:
        # Synchronous handlers would run on grpc's thread pool outside our hooks (and outside auth);
        # every qmill handler is async, so refuse rather than serve one unchecked.
        raise TypeError(f"{method}: qmill interceptors need async handlers")
    return make(
        behavior,
        request_deserializer=_guarded(
            _counting(handler.request_deserializer, on_request_bytes, into=True), checks
        ),
        response_serializer=_counting(handler.response_serializer, on_response_bytes, into=False),
    )


async def _write(context: Any, response: Any) -> None:
    """Sends one response. A client killed (or cancelled) while the server writes makes grpc's
    write fail in its core (ExecuteBatchError, a grpc.aio.InternalError); yielded to grpc, that
    failure is logged as an ERROR with a traceback. It is an ordinary event: the call ends as
    cancelled (the call's one log line says CANCELLED) and its memory goes with it."""
    try:
        await context.write(response)
    except grpc.aio.InternalError as e:
        raise asyncio.CancelledError(f"the client went away mid-response ({e})") from e


class Undecodable:
    """Stands for a request message grpc could not decode. grpc.aio answers a deserializer that
    raises with INTERNAL and logs a traceback; the handler answers this with INVALID_ARGUMENT
    and the call's one log line instead."""

    def __init__(self, error: Exception) -> None:
        self.message = (
            f"a request message is not valid protobuf for this RPC ({type(error).__name__}: "
            f"{error}); send messages of the qmill.v1 proto this server serves"
        )


class UndecodableMessage(ValueError):
    """A streamed request message that could not be decoded (mapped to INVALID_ARGUMENT)."""


def _guarded(
    deserialize: Callable[[bytes], Any] | None, guard: bool
) -> Callable[[bytes], Any] | None:
    """`deserialize`, answering Undecodable instead of raising when `guard`; marked as guarded
    either way (outer wraps of a guarded handler only count bytes)."""
    if deserialize is None:
        return None
    if guard:
        decode_or_raise = deserialize

        def deserialize(data: bytes) -> Any:
            try:
                return decode_or_raise(data)
            except Exception as e:  # DecodeError and kin: the bytes are the client's fault
                return Undecodable(e)

    deserialize.qmill_guarded = True  # type: ignore[attr-defined]
    return deserialize


async def _decoded(request: Any, streaming: bool, context: Any) -> Any:
    """The request, checked: an undecodable unary request aborts the call; a stream of requests
    raises UndecodableMessage where the handler reads the bad one."""
    if not streaming:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return request

    async def checked() -> Any:
        async for message in request:
            if isinstance(message, Undecodable):
                raise UndecodableMessage(message.message)
            yield message

    return checked()


def _counting(
    convert: Callable[[Any], Any] | None, count: Callable[[int], None] | None, *, into: bool
) -> Callable[[Any], Any] | None:
    """`convert` (a deserializer when `into`, else a serializer) that also counts wire bytes."""
    if count is None:
        return convert
    step = convert or (lambda data: data)  # no (de)serializer: grpc hands over raw bytes

    if into:

        def deserialize(data: bytes) -> Any:
            count(len(data))
            return step(data)

        return deserialize

    def serialize(message: Any) -> bytes:
        data = step(message)
        count(len(data))
        return data

    return serialize
