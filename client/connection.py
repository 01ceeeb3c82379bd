"""One channel to a qmill server, sync or asyncio, and how every call on it is made.

Every RPC of the Client goes through `unary` or `stream` here, which run it inside
errors.mapped(): a failed call, or a server's bytes that break the wire contract, reach the caller
as one QmillError, whichever service failed. `drive` runs a conversation of several calls written
once for both kinds of connection (an upload: start, send, ask where to resume, send again).
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Sequence
from typing import Any, TypeVar

from qmill.client import channels, errors
from qmill.client import credentials as credentials_lib
from qmill.proto import framing, wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc

T = TypeVar("T")
# Responses carry chunks of up to 4 MiB plus framing: twice that, both ways.
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 2 * wire.MAX_CHUNK_BYTES),
    ("grpc.max_send_message_length", 2 * wire.MAX_CHUNK_BYTES),
)
_STUBS = {
    "Quantizer": pb_grpc.QuantizerStub,
    "Calibrator": pb_grpc.CalibratorStub,
    "Uploads": pb_grpc.UploadsStub,
    "OdmlExporter": pb_grpc.OdmlExporterStub,
    "Jobs": pb_grpc.JobsStub,
    "Admin": pb_grpc.AdminStub,
}
# Stream methods whose requests may also be bytes already serialized (framing.encoded_chunks: a
# tensor's chunks with one copy instead of four), with their response type, whose chunk
# responses are decoded without protobuf (framing.chunk_decoder: a view of grpc's bytes instead of
# two more copies, protobuf's parse and the read of the chunk's data).
_PASS_THROUGH = {("Quantizer", "QuantizeParams"): pb.QuantizeParamsResponse}


# A step of a conversation: (service, method, request); the answer is sent back into it.
Step = tuple[str, str, Any]
Conversation = Generator[Step, Any, T]
# `timeout=DEFAULT`: the connection's own.
DEFAULT: Any = object()


class _Requests:
    """A call's request iterator that ends with the call.

    grpc reads a stream's requests in a thread of its own, which goes on reading (a checkpoint's
    next tensor) after the call has failed; if the process exits meanwhile, that read fails on
    the interpreter's shut-down executors and grpc logs "Exception iterating requests!" with a
    traceback, after the one-line error. Once ended, no more requests are read, and what the
    read under way raises is dropped: the call's own error is the one that counts.
    """

    def __init__(self, requests: Iterator[Any]) -> None:
        self._requests = requests
        self._ended = threading.Event()

    def __iter__(self) -> _Requests:
        return self

    def __next__(self) -> Any:
        if self._ended.is_set():
            raise StopIteration
        try:
            return next(self._requests)
        except Exception:
            if self._ended.is_set():
                raise StopIteration from None
            raise

    def end(self) -> None:
        self._ended.set()


class _Base:
    # Makes the channel: channels.channel or channels.aio_channel.
    _open: Callable[..., Any]

    def __init__(
        self,
        target: str,
        credentials: credentials_lib.Credentials,
        *,
        timeout: float | None,
        options: Sequence[tuple[str, Any]],
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.channel = self._open(target, credentials, [*CHANNEL_OPTIONS, *options])
        self._stubs: dict[str, Any] = {}

    def _method(self, service: str, method: str) -> Any:
        if (service, method) in _PASS_THROUGH:
            return self._pass_through(service, method)
        if service not in self._stubs:
            self._stubs[service] = _STUBS[service](self.channel)
        return getattr(self._stubs[service], method)

    def _pass_through(self, service: str, method: str) -> Any:
        key = f"{service}.{method}"
        if key not in self._stubs:
            self._stubs[key] = self.channel.stream_stream(
                f"/qmill.v1.{service}/{method}",
                request_serializer=framing.serialized,
                response_deserializer=framing.chunk_decoder(_PASS_THROUGH[service, method]),
            )
        return self._stubs[key]

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is DEFAULT else timeout


class Connection(_Base):
    """A grpc.Channel (TLS, token and request id from `credentials`) and its calls."""

    _open = staticmethod(channels.channel)

    def close(self) -> None:
        self.channel.close()

    def unary(
        self,
        service: str,
        method: str,
        request: Any,
        *,
        then: Callable[[Any], Any] | None = None,
        timeout: float | None = DEFAULT,
    ) -> Any:
        """The response of one call (a request iterator for a client stream), through `then`."""
        if isinstance(request, Iterator):
            request = _Requests(request)  # a client stream's requests end with the call
        try:
            with errors.mapped():
                response = self._method(service, method)(request, timeout=self._timeout(timeout))
        finally:
            if isinstance(request, _Requests):
                request.end()
        return response if then is None else then(response)

    def stream(
        self,
        service: str,
        method: str,
        request: Any,
        feed: Callable[[Any], T | None],
        *,
        finish: Callable[[], None] | None = None,
        timeout: float | None = DEFAULT,
    ) -> Iterator[T]:
        """What `feed` makes of the server's responses (None: nothing yet), then `finish()`.

        The call is cancelled when the caller stops early.
        """
        if isinstance(request, Iterator):
            request = _Requests(request)
        call = self._method(service, method)(request, timeout=self._timeout(timeout))
        try:
            with errors.mapped():
                for response in call:
                    item = feed(response)
                    if item is not None:
                        yield item
                if finish is not None:
                    finish()
        finally:
            call.cancel()
            if isinstance(request, _Requests):
                request.end()

    def drive(self, conversation: Conversation[T]) -> T:
        """Runs a conversation: each step's call, its response (or QmillError) sent back."""
        try:
            step = next(conversation)
            while True:
                try:
                    response = self.unary(*step)
                except errors.QmillError as e:
                    step = conversation.throw(e)
                else:
                    step = conversation.send(response)
        except StopIteration as done:
            return done.value


class AsyncConnection(_Base):
    """The asyncio counterpart of Connection: the same calls, awaited."""

    _open = staticmethod(channels.aio_channel)

    async def close(self) -> None:
        await self.channel.close()

    async def unary(
        self,
        service: str,
        method: str,
        request: Any,
        *,
        then: Callable[[Any], Any] | None = None,
        timeout: float | None = DEFAULT,
    ) -> Any:
        with errors.mapped():
            response = await self._method(service, method)(request, timeout=self._timeout(timeout))
        return response if then is None else then(response)

    async def stream(
        self,
        service: str,
        method: str,
        request: Any,
        feed: Callable[[Any], T | None],
        *,
        finish: Callable[[], None] | None = None,
        timeout: float | None = DEFAULT,
    ) -> AsyncIterator[T]:
        call = self._method(service, method)(request, timeout=self._timeout(timeout))
        try:
            with errors.mapped():
                async for response in call:
                    item = feed(response)
                    if item is not None:
                        yield item
                if finish is not None:
                    finish()
        finally:
            call.cancel()

    async def drive(self, conversation: Conversation[T]) -> T:
        try:
            step = next(conversation)
            while True:
                try:
                    response = await self.unary(*step)
                except errors.QmillError as e:
                    step = conversation.throw(e)
                else:
                    step = conversation.send(response)
        except StopIteration as done:
            return done.value
