"""One QuantizeParams call: assemble tensors from the request stream, quantize, stream results.

Receiving overlaps with quantizing: a reader task assembles the next tensor while the previous one
is quantized, and starts on the one after only once the engine has taken it (_hand_over). Memory
per call is therefore about two tensors (one arriving, one being quantized or waiting for the
engine) plus results on their way out; with a finished tensor allowed to wait as well it was three,
for no gain in throughput (bench/README.md, issue 27). Results are handed over the same way: the
engine quantizes the next tensor only once the responder has taken the previous result, so at most
two results are held (one on the wire, one finished and waiting), not three. Each tensor's
bytes are reserved with the server's ByteLimiter before its buffer is allocated and released once
its answer is sent (or the call ends), so all calls together stay within the in-flight limit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent import futures

import numpy as np

from qmill.engine.modelfree import layout, leaf, recipes
from qmill.proto import memory, wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import auth, codec, errors, limits
from qmill.server import metrics as metrics_lib
from qmill.server.uploads import store as uploads_lib


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
# (tenant, upload_id) -> the upload's tensors, unread (uploads_lib.UploadStore.tensors).
UploadTensors = Callable[[str, str], Sequence[uploads_lib.StoredTensor]]


async def _read_tensors(
    requests: AsyncIterator[pb.QuantizeParamsRequest],
    queue: asyncio.Queue,
    max_tensor_bytes: int,
    stats: CallStats,
    account: limits.Account | None,
    upload: Callable[[str], AsyncIterator[tuple[pb.TensorHeader, np.ndarray]]] | None = None,
) -> None:
    """Puts (header, array) for each complete tensor on the queue, then _END (or an exception)."""
    try:
        inbox = limits.TensorInbox(max_tensor_bytes, account)
        from_upload = False
        async for request in inbox.requests(requests):
            kind = request.WhichOneof("item")
            if from_upload:
                raise ValueError("nothing may follow upload_id: its tensors come from the upload")
            if kind == "upload_id":
                if upload is None:
                    raise errors.Unimplemented("this server keeps no uploads")
                if inbox.receiving or stats.tensors_received:
                    raise ValueError("send upload_id right after the recipe, instead of tensors")
                from_upload = True
                async for item in upload(request.upload_id):
                    await _hand_over(queue, item)
                continue
            if kind == "header":
                await inbox.announce(request.header)
            elif kind == "chunk":
                chunk = wire.chunk_of(request.chunk)  # its bytes copied out once, not twice
                await inbox.add(chunk)
                stats.bytes_received += len(chunk.data)
            elif kind == "recipe":
                raise ValueError("the recipe must be sent once, as the first message")
            else:
                raise ValueError("empty request: set one of recipe, header or chunk")
            for item in inbox.take():
                stats.tensors_received += 1
                await _hand_over(queue, item)
        inbox.close()  # the stream ended mid-tensor: DATA_LOSS
        await queue.put(_END)
    except asyncio.CancelledError:
        # The responder is gone (call over); waiting to hand this over would never end.
        raise
    except BaseException as exc:  # handed to the responder, which owns the call's status
        await queue.put(exc)


async def _hand_over(queue: asyncio.Queue, item: tuple[pb.TensorHeader, np.ndarray]) -> None:
    """Puts a tensor on the queue and returns once the engine has taken it (task_done): the
    next tensor is assembled while this one is quantized, not while it waits for the engine."""
    await queue.put(item)
    await queue.join()


async def _upload_tensors(
    tensors: UploadTensors,
    tenant: str,
    upload_id: str,
    max_tensor_bytes: int,
    stats: CallStats,
    account: limits.Account | None,
) -> AsyncIterator[tuple[pb.TensorHeader, np.ndarray]]:
    """(header, array) per tensor of a stored upload, read one at a time off the event loop,
    each reserved with the limiter first like a streamed tensor."""
    for t in await asyncio.to_thread(tensors, tenant, upload_id):
        header = pb.TensorHeader(
            path=t.path, dtype=wire.to_wire_dtype(t.dtype), shape=t.shape, byte_length=t.nbytes
        )
        if t.nbytes > max_tensor_bytes:
            raise errors.ResourceExhausted(
                f"tensor {t.path} of upload {upload_id} has {t.nbytes} bytes, over this "
                f"server's limit of {max_tensor_bytes} (--max-tensor-bytes)"
            )
        if account is not None:
            await account.reserve(t.nbytes)
        try:
            array = await asyncio.to_thread(t.read)
        except BaseException:
            if account is not None:
                account.release(t.nbytes)
            raise
        stats.tensors_received += 1
        stats.bytes_received += t.nbytes
        yield header, array


# When a stream's end is followed by a second malloc_trim (see quantize_stream).
LATE_TRIM_SECONDS = 1.0


def _empty(*queues: asyncio.Queue) -> None:
    for waiting in queues:
        while not waiting.empty():
            waiting.get_nowait()


async def quantize_stream(
    requests: AsyncIterator[pb.QuantizeParamsRequest],
    executor: futures.Executor,
    max_tensor_bytes: int,
    stats: CallStats,
    quantize: Callable[[np.ndarray, layout.LeafPlan], leaf.LeafResult] = leaf.quantize_leaf,
    *,
    limiter: limits.ByteLimiter | None = None,
    metrics: metrics_lib.Metrics | None = None,
    upload_tensors: UploadTensors | None = None,
    encode_chunks: bool = False,
) -> AsyncIterator[pb.QuantizeParamsResponse | bytes]:
    """Responses for one QuantizeParams call, in the order the tensors arrived (or, with an
    upload_id, in the upload's order).

    With `encode_chunks`, a result's chunks come as serialized responses (bytes, for a
    serializer that passes them through: framing.serialized), one copy of their data each instead
    of four (tobytes, the chunk, the response, serializing it)."""
    first = await codec.first_item(requests, "recipe", "the recipe")
    recipe = codec.recipe_from_proto(first)
    tenant = auth.current_principal().tenant
    account = limits.Account(limiter, tenant) if limiter else None
    queue: asyncio.Queue = asyncio.Queue(maxsize=1)
    upload = None
    if upload_tensors is not None:

        def upload(uid: str) -> AsyncIterator[tuple[pb.TensorHeader, np.ndarray]]:
            return _upload_tensors(upload_tensors, tenant, uid, max_tensor_bytes, stats, account)

    reader = asyncio.create_task(
        _read_tensors(requests, queue, max_tensor_bytes, stats, account, upload)
    )
    # Quantizing runs a tensor ahead of sending: tensor k+1 is quantized while k's results are
    # on the wire and k+2 arrives; k+2 is quantized only once k's are all sent (_Engine.run), so
    # one finished result at most waits between the two.
    results: asyncio.Queue = asyncio.Queue(maxsize=1)
    engine = _Engine(executor, quantize, recipe, stats, account, metrics)
    quantizer = asyncio.create_task(engine.run(queue, results))
    try:
        while (item := await results.get()) is not _END:
            results.task_done()  # the engine may quantize the next tensor (_Engine.run)
            if isinstance(item, BaseException):
                raise item
            header, plan, result = item
            if result is None:
                yield pb.QuantizeParamsResponse(result=codec.kept_result(plan, header.byte_length))
                _answered(account, metrics, header, "kept")
                continue
            message, data = codec.quantized_parts(plan, result, header.byte_length)
            del result
            response_type = pb.QuantizeParamsResponse
            if encode_chunks:
                responses = codec.encoded_messages(response_type, "result", message, data)
            else:
                chunks = (chunk for piece in data for chunk in wire.chunks(piece))
                responses = codec.messages(response_type, "result", message, chunks)
            del data  # the responses hold the parts until they are sent
            for response in responses:
                yield response
            # From the parts' headers: reading response.chunk.data would copy every chunk again.
            stats.bytes_sent += sum(part.byte_length for part in message.parts)
            _answered(account, metrics, header, "quantized")
        yield pb.QuantizeParamsResponse(summary=stats.summary())
    finally:
        item = None  # an error raised from it: its traceback holds this frame
        _end_call((reader, quantizer), (queue, results), account)


def _end_call(
    tasks: tuple[asyncio.Task, ...],
    queues: tuple[asyncio.Queue, ...],
    account: limits.Account | None,
) -> None:
    """What a call leaves behind, let go: its tasks cancelled, its queues emptied, its bytes
    given back to the limiter and the heap."""
    for task in tasks:
        task.cancel()
    # A call cut short (its client killed) leaves the reader's error in the queue, holding its
    # traceback, whose frames hold the queue and the tensor being received: a cycle that only the
    # garbage collector would free, much later. The queues are emptied once both tasks have ended
    # (a cancelled task may still put one last item).
    for task in tasks:
        task.add_done_callback(lambda _: _empty(*queues))
    if account is not None:
        account.close()  # whatever the call still holds (cancelled, failed) goes back now
    wire.release_buffers()  # kept for this call's next tensor: there is none
    # Free heap pages (4 MiB chunk copies, the engine's outputs) otherwise stay resident between
    # calls: the next call's peak RSS started ~80 MB higher (bench/README.md).
    memory.give_back_free_memory()
    # Once more a moment later: a call whose client is gone frees its last buffers (grpc's, the
    # tasks' above) after this point, and the server may have no next call for a while.
    asyncio.get_running_loop().call_later(LATE_TRIM_SECONDS, memory.give_back_free_memory)


@dataclasses.dataclass
class _Engine:
    """Takes assembled tensors off one queue and puts (header, plan, result or None for a kept
    tensor) on another, then _END (or the exception that stopped it)."""

    executor: futures.Executor
    quantize: Callable[[np.ndarray, layout.LeafPlan], leaf.LeafResult]
    recipe: recipes.Recipe
    stats: CallStats
    account: limits.Account | None
    metrics: metrics_lib.Metrics | None

    async def run(self, tensors: asyncio.Queue, results: asyncio.Queue) -> None:
        loop = asyncio.get_running_loop()
        try:
            while (item := await tensors.get()) is not _END:
                tensors.task_done()  # the reader may assemble the next one (_hand_over)
                if isinstance(item, BaseException):
                    raise item
                header, array = item
                plan = layout.plan_leaf(header.path, tuple(header.shape), array.dtype, self.recipe)
                if not plan.quantize:
                    del array
                    await results.put((header, plan, None))
                    continue
                # The previous result must be taken first: its send is under way when this one
                # is done, so a third (one sent, one waiting, this one) is never held; the
                # reader meanwhile assembles the next tensor (task_done above).
                await results.join()
                work = loop.run_in_executor(self.executor, self.quantize, array, plan)
                if self.account is not None:
                    self.account.hold_until_done(work)  # the engine thread reads the bytes
                started = time.monotonic()
                result = await work
                if self.metrics is not None:
                    self.metrics.quantize_seconds.observe(time.monotonic() - started)
                del array
                self.stats.tensors_quantized += 1
                await results.put((header, plan, result))
            await results.put(_END)
        except asyncio.CancelledError:
            raise  # the call is over; nobody takes results any more
        except BaseException as exc:  # handed to the responder, which owns the call's status
            item = None  # a reader's error raised here: its traceback holds this frame
            await results.put(exc)


def _answered(
    account: limits.Account | None,
    metrics: metrics_lib.Metrics | None,
    header: pb.TensorHeader,
    result: str,
) -> None:
    if account is not None:
        account.release(header.byte_length)
    if metrics is not None:
        metrics.tensors.labels(result=result).inc()
