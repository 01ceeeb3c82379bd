"""One QuantizeParams call: assemble tensors from the request stream, quantize, stream results.

Receiving overlaps with quantizing: a reader task assembles the next tensor while the previous one
is quantized, with at most one finished tensor waiting between them. Memory per call is therefore
about three tensors (one arriving, one waiting, one being quantized) plus its result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from concurrent import futures

import numpy as np

from qmill.engine import layout, leaf, recipes
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import codec


@dataclasses.dataclass
class CallStats:
    tensors_received: int = 0
    tensors_quantized: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    started: float = dataclasses.field(default_factory=time.monotonic)

    def summary(self) -> pb.Summary:
        return pb.Summary(
            tensors_received=self.tensors_received,
            tensors_quantized=self.tensors_quantized,
            bytes_received=self.bytes_received,
            bytes_sent=self.bytes_sent,
            seconds=time.monotonic() - self.started,
        )


_END = object()


async def _read_tensors(
    requests: AsyncIterator[pb.QuantizeParamsRequest],
    queue: asyncio.Queue,
    max_tensor_bytes: int,
    stats: CallStats,
) -> None:
    """Puts (header, array) for each complete tensor on the queue, then _END (or an exception)."""
    try:
        assembler: wire.Assembler | None = None
        async for request in requests:
            kind = request.WhichOneof("item")
            if kind == "header":
                if assembler is not None:
                    assembler.finish()  # raises DATA_LOSS: the previous tensor was cut short
                assembler = wire.Assembler(request.header, max_bytes=max_tensor_bytes)
            elif kind == "chunk":
                if assembler is None:
                    raise ValueError("a chunk arrived before any tensor header")
                assembler.add(request.chunk)
                stats.bytes_received += len(request.chunk.data)
            elif kind == "recipe":
                raise ValueError("the recipe must be sent once, as the first message")
            else:
                raise ValueError("empty request: set one of recipe, header or chunk")
            if assembler is not None and assembler.complete:
                array = assembler.finish()
                stats.tensors_received += 1
                await queue.put((assembler.header, array))
                assembler = None
        if assembler is not None:
            assembler.finish()  # the stream ended mid-tensor: DATA_LOSS
        await queue.put(_END)
    except BaseException as exc:  # handed to the responder, which owns the call's status
        await queue.put(exc)


async def first_recipe(requests: AsyncIterator[pb.QuantizeParamsRequest]) -> recipes.Recipe:
    try:
        first = await anext(requests)
    except StopAsyncIteration:
        raise ValueError("empty stream: send the recipe first") from None
    if first.WhichOneof("item") != "recipe":
        raise ValueError("the first message must be the recipe")
    return codec.recipe_from_proto(first.recipe)


async def quantize_stream(
    requests: AsyncIterator[pb.QuantizeParamsRequest],
    executor: futures.Executor,
    max_tensor_bytes: int,
    stats: CallStats,
    quantize: Callable[[np.ndarray, layout.LeafPlan], leaf.LeafResult] = leaf.quantize_leaf,
) -> AsyncIterator[pb.QuantizeParamsResponse]:
    """Responses for one QuantizeParams call, in the order the tensors arrived."""
    recipe = await first_recipe(requests)
    queue: asyncio.Queue = asyncio.Queue(maxsize=1)
    reader = asyncio.create_task(_read_tensors(requests, queue, max_tensor_bytes, stats))
    loop = asyncio.get_running_loop()
    try:
        while (item := await queue.get()) is not _END:
            if isinstance(item, BaseException):
                raise item
            header, array = item
            plan = layout.plan_leaf(header.path, tuple(header.shape), array.dtype, recipe)
            if not plan.quantize:
                yield codec.kept_response(plan, header.byte_length)
                continue
            result = await loop.run_in_executor(executor, quantize, array, plan)
            del array
            stats.tensors_quantized += 1
            for response in codec.result_responses(plan, result, header.byte_length):
                stats.bytes_sent += len(response.chunk.data)
                yield response
        yield pb.QuantizeParamsResponse(summary=stats.summary())
    finally:
        reader.cancel()
