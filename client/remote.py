"""Client and AsyncClient: one channel each, every RPC failure raised as QmillError.

Tensors are sent within a window of in-flight bytes: a tensor is sent only when the bytes of the
tensors sent but not yet answered leave room for it (one tensor always fits). Memory on the client
stays bounded by the window plus the tensor being written, whatever the checkpoint's size.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any

import grpc
import numpy as np

from qmill.checkpoints import outcome as outcome_lib
from qmill.client import credentials as credentials_lib
from qmill.client import errors, streaming
from qmill.proto import recipe as recipe_proto
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc

DEFAULT_WINDOW_BYTES = 256 * 1024 * 1024
_OPTIONS = [
    ("grpc.max_receive_message_length", 2 * wire.MAX_CHUNK_BYTES),
    ("grpc.max_send_message_length", 2 * wire.MAX_CHUNK_BYTES),
]


def _wire_bytes(array: np.ndarray) -> int:
    # The unit the server reports back as input_bytes, so acquire and release always balance.
    return wire.byte_length(wire.to_wire_dtype(array.dtype), array.shape)


class _Window:
    """In-flight byte budget shared by the request generator and the response loop."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._closed = False
        self._cv = threading.Condition()

    def acquire(self, n: int) -> bool:
        with self._cv:
            self._cv.wait_for(
                lambda: self._closed or not self._used or self._used + n <= self._limit
            )
            self._used += n
            return not self._closed

    def release(self, n: int) -> None:
        with self._cv:
            self._used -= n
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


class Client:
    """Synchronous qmill client.

    Example:
        with Client("127.0.0.1:50051") as client:
            for outcome in client.quantize({"rules": [{"qtype": "int8"}]}, tensors):
                ...
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        credentials: credentials_lib.Credentials | None = None,
    ) -> None:
        """`credentials`: TLS, token and request id; default plaintext with $QMILL_TOKEN."""
        self.target = target
        self.timeout = timeout
        creds = credentials if credentials is not None else credentials_lib.default()
        self._channel = credentials_lib.channel(target, creds, _OPTIONS)
        self._stub = pb_grpc.QuantizerStub(self._channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def capabilities(self) -> pb.GetCapabilitiesResponse:
        try:
            return self._stub.GetCapabilities(pb.GetCapabilitiesRequest(), timeout=self.timeout)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    def quantize(
        self,
        recipe: dict[str, Any],
        tensors: Iterable[tuple[str, np.ndarray]],
        *,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
    ) -> Iterator[outcome_lib.TensorOutcome]:
        """Quantizes `tensors` (path, array) as `recipe` says; yields outcomes in input order."""
        window = _Window(window_bytes)
        sent: dict[str, np.ndarray] = {}
        decoder = streaming.ResponseDecoder(sent)
        message = recipe_proto.from_mapping(recipe)

        def requests() -> Iterator[pb.QuantizeParamsRequest]:
            yield pb.QuantizeParamsRequest(recipe=message)
            for path, array in tensors:
                if not window.acquire(_wire_bytes(array)):
                    return
                sent[path] = array
                yield from streaming.tensor_requests(path, array)

        call = self._stub.QuantizeParams(requests(), timeout=self.timeout)
        try:
            for response in call:
                outcome = decoder.feed(response)
                if outcome is not None:
                    yield outcome
                    window.release(outcome.input_bytes)
            decoder.check_finished()
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None
        except wire.WireError as e:
            raise errors.QmillError(e.code, str(e)) from None
        finally:
            window.close()
            call.cancel()


class AsyncClient:
    """asyncio qmill client, the same calls as Client."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = None,
        credentials: credentials_lib.Credentials | None = None,
    ) -> None:
        self.target = target
        self.timeout = timeout
        creds = credentials if credentials is not None else credentials_lib.default()
        self._channel = credentials_lib.aio_channel(target, creds, _OPTIONS)
        self._stub = pb_grpc.QuantizerStub(self._channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def capabilities(self) -> pb.GetCapabilitiesResponse:
        try:
            return await self._stub.GetCapabilities(
                pb.GetCapabilitiesRequest(), timeout=self.timeout
            )
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    async def quantize(
        self,
        recipe: dict[str, Any],
        tensors: Iterable[tuple[str, np.ndarray]] | AsyncIterable[tuple[str, np.ndarray]],
        *,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
    ) -> AsyncIterator[outcome_lib.TensorOutcome]:
        """Quantizes `tensors` as `recipe` says; yields outcomes in input order."""
        used = 0
        room = asyncio.Condition()
        sent: dict[str, np.ndarray] = {}
        decoder = streaming.ResponseDecoder(sent)
        message = recipe_proto.from_mapping(recipe)

        async def each_tensor() -> AsyncIterator[tuple[str, np.ndarray]]:
            if isinstance(tensors, AsyncIterable):
                async for item in tensors:
                    yield item
            else:
                for item in tensors:
                    yield item

        async def requests() -> AsyncIterator[pb.QuantizeParamsRequest]:
            nonlocal used
            yield pb.QuantizeParamsRequest(recipe=message)
            async for path, array in each_tensor():
                async with room:
                    n = _wire_bytes(array)
                    await room.wait_for(lambda: not used or used + n <= window_bytes)  # noqa: B023
                    used += n
                sent[path] = array
                for request in streaming.tensor_requests(path, array):
                    yield request

        call = self._stub.QuantizeParams(requests(), timeout=self.timeout)
        try:
            async for response in call:
                outcome = decoder.feed(response)
                if outcome is not None:
                    yield outcome
                    async with room:
                        used -= outcome.input_bytes
                        room.notify_all()
            decoder.check_finished()
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None
        except wire.WireError as e:
            raise errors.QmillError(e.code, str(e)) from None
        finally:
            call.cancel()
