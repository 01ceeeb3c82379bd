"""server/quantizer/stream.py without gRPC: the pipeline quantizes a tensor ahead of sending."""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import numpy as np
import pytest

from qmill.engine.modelfree import leaf
from qmill.proto import recipe as recipe_lib
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server.quantizer import stream


def _requests(count: int) -> list[pb.QuantizeParamsRequest]:
    recipe = recipe_lib.from_mapping({"rules": [{"qtype": "int8"}]})
    messages = [pb.QuantizeParamsRequest(recipe=recipe)]
    for i in range(count):
        array = np.full((16, 32), i + 1, np.float32)
        messages += wire.send(pb.QuantizeParamsRequest, "header", f"layers.{i}.weight", array)
    return messages


async def _aiter(items):
    for item in items:
        yield item


def test_tensor_k_plus_1_is_quantized_while_k_is_being_sent():
    started: list[str] = []
    second = threading.Event()

    def quantize(array, plan):
        started.append(plan.path)
        if len(started) == 2:
            second.set()
        return leaf.quantize_leaf(array, plan)

    async def run() -> list[pb.QuantizeParamsResponse]:
        with futures.ThreadPoolExecutor(1) as executor:
            responses = stream.quantize_stream(
                _aiter(_requests(3)), executor, 1 << 20, stream.CallStats(), quantize
            )
            first = await anext(responses)
            assert first.result.path == "layers.0.weight"
            # Tensor 0's parts are not taken yet: its send is under way. Tensor 1 is quantized
            # meanwhile (a one-at-a-time pipeline would wait here for ever).
            assert await asyncio.to_thread(second.wait, 30)
            return [first] + [r async for r in responses]

    responses = asyncio.run(run())
    assert started == ["layers.0.weight", "layers.1.weight", "layers.2.weight"]
    results = [r.result.path for r in responses if r.WhichOneof("item") == "result"]
    assert results == started  # answers keep the arrival order
    summary = responses[-1].summary
    assert summary.tensors_received == summary.tensors_quantized == 3
    # Counted from the parts' headers; the chunks that went out carry exactly those bytes.
    chunks = sum(len(r.chunk.data) for r in responses if r.WhichOneof("item") == "chunk")
    parts = sum(p.byte_length for r in responses if r.HasField("result") for p in r.result.parts)
    assert summary.bytes_sent == chunks == parts > 3 * 16 * 32


def test_an_engine_error_ends_the_stream_with_it():
    def quantize(array, plan):
        raise ValueError("the engine refuses layers.0.weight")

    async def run() -> None:
        with futures.ThreadPoolExecutor(1) as executor:
            responses = stream.quantize_stream(
                _aiter(_requests(2)), executor, 1 << 20, stream.CallStats(), quantize
            )
            async for _ in responses:
                pass

    with pytest.raises(ValueError, match=r"the engine refuses layers\.0\.weight"):
        asyncio.run(run())


def test_encoded_chunks_are_the_bytes_of_the_chunk_responses():
    async def run(encode_chunks: bool) -> list:
        with futures.ThreadPoolExecutor(1) as executor:
            responses = stream.quantize_stream(
                _aiter(_requests(2)),
                executor,
                1 << 20,
                stream.CallStats(),
                encode_chunks=encode_chunks,
            )
            return [r async for r in responses]

    plain, encoded = asyncio.run(run(False)), asyncio.run(run(True))
    assert len(plain) == len(encoded)
    assert any(m.WhichOneof("item") == "chunk" for m in plain)  # the case the test is about
    for message, item in zip(plain, encoded, strict=True):
        if message.WhichOneof("item") == "chunk":
            assert item == message.SerializeToString()  # serialized, byte for byte
        else:
            assert item.WhichOneof("item") == message.WhichOneof("item")  # results, summary
            if message.HasField("result"):
                assert item.result == message.result


def test_a_call_holds_two_tensors_while_the_engine_works():
    # One being quantized, the next assembled; the one after waits in the request stream until
    # the engine takes that one (a third would cost a tensor of server memory, no throughput).
    busy, release = threading.Event(), threading.Event()

    def quantize(array, plan):
        busy.set()
        assert release.wait(30)
        return leaf.quantize_leaf(array, plan)

    async def run() -> int:
        with futures.ThreadPoolExecutor(1) as executor:
            stats = stream.CallStats()
            responses = stream.quantize_stream(
                _aiter(_requests(4)), executor, 1 << 20, stats, quantize
            )
            first = asyncio.ensure_future(anext(responses))
            assert await asyncio.to_thread(busy.wait, 30)
            for _ in range(50):  # the reader runs as far as it may
                await asyncio.sleep(0.01)
            held = stats.tensors_received
            release.set()
            await first
            rest = [r async for r in responses]
            assert rest[-1].summary.tensors_quantized == 4
            return held

    assert asyncio.run(run()) == 2


def test_a_call_holds_two_results_while_the_client_reads_slowly():
    # One result on the wire, the next finished and waiting: the engine quantizes the one after
    # only once the responder takes that (a third result would cost ~17 MB of a 64 MiB float32
    # tensor's int8 codes and scales, no throughput). The reader still assembles the next tensor.
    started: list[str] = []

    def quantize(array, plan):
        started.append(plan.path)
        return leaf.quantize_leaf(array, plan)

    async def run() -> tuple[int, int]:
        with futures.ThreadPoolExecutor(1) as executor:
            stats = stream.CallStats()
            responses = stream.quantize_stream(
                _aiter(_requests(6)), executor, 1 << 20, stats, quantize
            )
            first = await anext(responses)
            assert first.result.path == "layers.0.weight"
            for _ in range(50):  # the engine and the reader run as far as they may
                await asyncio.sleep(0.01)
            held = len(started), stats.tensors_received
            rest = [r async for r in responses]
            assert rest[-1].summary.tensors_quantized == 6
            return held

    # Quantized: 0 (being sent) and 1 (waiting); received: 2 (taken by the engine), 3 (waiting).
    assert asyncio.run(run()) == (2, 4)
