"""The QuantizeParams conversation without transport: requests out, outcomes in.

Shared by the sync and async clients, so both hand the caller the same `TensorOutcome` records.

Tensors are sent within a window of in-flight bytes: a tensor is sent only when the bytes of the
tensors sent but not yet answered leave room for it (one tensor always fits). Memory on the client
stays bounded by the window plus the tensor being written, whatever the checkpoint's size.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any

import numpy as np

from qmill.checkpoints.base import dtypes
from qmill.checkpoints.formats.safetensors import source as safetensors_source
from qmill.checkpoints.run import outcome
from qmill.proto import framing, memory, wire
from qmill.proto.v1 import qmill_pb2 as pb

DEFAULT_WINDOW_BYTES = 256 * 1024 * 1024


def tensor_requests(path: str, array: np.ndarray) -> Iterator[pb.QuantizeParamsRequest]:
    """Header and chunk requests for one tensor."""
    return wire.send(pb.QuantizeParamsRequest, "header", path, array)


def encoded_tensor_requests(
    path: str, array: np.ndarray
) -> Iterator[pb.QuantizeParamsRequest | bytes]:
    """tensor_requests(path, array) with the chunks as serialized requests (one copy of the
    data each); for the client's connection, which sends bytes as they are."""
    data = wire.to_bytes(array)
    # A tensor mapped from a file (qmill quantize --server) is checked before each touch of its
    # pages and after the last: a file truncated meanwhile is an error, not SIGBUS, and a file
    # rewritten meanwhile is an error, not its new bytes (safetensors_source._Watch).
    unchanged = safetensors_source.unchanged_check(data)
    unchanged()
    header = wire.header_for(path, array, data)  # its crc32c reads every byte
    unchanged()
    yield pb.QuantizeParamsRequest(header=header)
    chunks = framing.encoded_chunks(pb.QuantizeParamsRequest, data)  # each copied as it is taken
    while (chunk := next(chunks, None)) is not None:
        unchanged()
        yield chunk


def keep_freed_buffers() -> None:
    """Lets a client streaming tensors reuse its freed message and result buffers (glibc).

    Each 4 MiB request and each result's parts are allocated and freed once per chunk; with
    glibc's defaults they are mapped and unmapped (or trimmed off the heap) every time, so
    their pages fault in and are zeroed again. proto/memory.py's tuning keeps them: on the
    2-core dev VM it took a 1 GiB run's client from ~115,000 page faults to ~35,000 and its
    CPU from ~2.0 to ~1.9 s (bench/README.md). Until staging stopped copying each part to
    bytes for its crc32c, that copy (16 MiB, freed at once) raised glibc's dynamic threshold
    by accident. Costs ~50 MB of client RSS; the server does not call it (its RSS matters).
    """
    memory.keep_freed_buffers()


def wire_bytes(array: np.ndarray) -> int:
    # The unit the server reports back as input_bytes, so acquire and release always balance.
    return wire.byte_length(wire.to_wire_dtype(array.dtype), array.shape)


def how_from_proto(how: pb.HowToQuantize) -> dict[str, Any]:
    return {
        "qtype": how.qtype,
        "channelwise_axes": tuple(how.channelwise_axes),
        "tiled_axes": dict(sorted(how.tiled_axes.items())),
        "calibration_method": how.calibration_method,
    }


class Window:
    """In-flight byte budget shared by the request generator and the response loop (threads)."""

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


def requests(
    recipe: pb.Recipe,
    tensors: Iterable[tuple[str, np.ndarray]],
    window: Window,
    sent: dict[str, np.ndarray],
    failed: list[BaseException] | None = None,
) -> Iterator[pb.QuantizeParamsRequest | bytes]:
    """The recipe, then each tensor once the window has room for it (until it closes).

    What stops the requests (a tensor that cannot be read, a source that changed) is also put
    in `failed`: grpc ends the call with only "Exception iterating requests!"."""
    keep_freed_buffers()
    yield pb.QuantizeParamsRequest(recipe=recipe)
    try:
        for path, array in tensors:
            if not window.acquire(wire_bytes(array)):
                return
            sent[path] = array
            yield from encoded_tensor_requests(path, array)
    except Exception as e:
        if failed is not None:
            failed.append(e)
        raise


class AsyncWindow:
    """Window for asyncio: the request generator and the response loop share one event loop."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._room = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._room:
            await self._room.wait_for(lambda: not self._used or self._used + n <= self._limit)
            self._used += n

    async def release(self, n: int) -> None:
        async with self._room:
            self._used -= n
            self._room.notify_all()


async def async_requests(
    recipe: pb.Recipe,
    tensors: Iterable[tuple[str, np.ndarray]] | AsyncIterable[tuple[str, np.ndarray]],
    window: AsyncWindow,
    sent: dict[str, np.ndarray],
) -> AsyncIterator[pb.QuantizeParamsRequest | bytes]:
    keep_freed_buffers()
    yield pb.QuantizeParamsRequest(recipe=recipe)
    async for path, array in _each(tensors):
        await window.acquire(wire_bytes(array))
        sent[path] = array
        for request in encoded_tensor_requests(path, array):
            yield request


async def _each(items: Iterable[Any] | AsyncIterable[Any]) -> AsyncIterator[Any]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


class ResponseDecoder:
    """Feeds on responses; returns a TensorOutcome each time a tensor is complete.

    `sent` maps paths of tensors sent but not yet answered to their arrays; the decoder removes
    each path when its answer is complete.
    """

    def __init__(self, sent: dict[str, np.ndarray]) -> None:
        self._sent = sent
        self._result: pb.TensorResult | None = None
        # 4-bit codes stay packed as they came: the checkpoint stores them so.
        self._receiver = wire.Receiver(packed=dtypes.Packed4)
        self.summary: pb.Summary | None = None

    def feed(self, response: pb.QuantizeParamsResponse) -> outcome.TensorOutcome | None:
        kind = response.WhichOneof("item")
        if kind == "summary":
            self.summary = response.summary
            return None
        if kind == "result":
            if self._result is not None:
                raise wire.WireError(
                    f"result for {response.result.path} before {self._result.path} ended",
                    "DATA_LOSS",
                )
            self._result = response.result
            self._receiver.announce(*response.result.parts)
        elif kind == "chunk":
            self._receiver.add(response.chunk)
        else:
            raise wire.WireError(f"unexpected response {kind!r}", "DATA_LOSS")
        if self._result is None or self._receiver.receiving:
            return None
        return self._outcome(dict(self._receiver.take()))

    def _outcome(self, parts: dict[str, np.ndarray]) -> outcome.TensorOutcome:
        result, self._result = self._result, None
        assert result is not None
        self._sent.pop(result.path, None)
        if result.kind == pb.RESULT_KIND_QUANTIZED:
            return outcome.TensorOutcome(
                path=result.path,
                quantized=True,
                parts=parts,
                reason=result.reason,
                how=how_from_proto(result.how),
                sqnr_db=result.quality.sqnr_db,
                mean_relative_error=result.quality.mean_relative_error,
                input_bytes=result.input_bytes,
            )
        # A float tensor the server made or holds (RESULT_KIND_FLOAT) came as the part "value".
        return outcome.TensorOutcome(
            path=result.path,
            quantized=False,
            parts=parts if result.kind == pb.RESULT_KIND_FLOAT else {},
            reason=result.reason,
            input_bytes=result.input_bytes,
        )

    def check_finished(self) -> None:
        """Raises DATA_LOSS if the server's stream ended without a summary or mid-tensor."""
        if self._result is not None or self.summary is None:
            raise wire.WireError("the server's stream ended before the summary", "DATA_LOSS")
