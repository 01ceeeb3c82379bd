"""The one Client against fake servicers: decoding, recipes given as presets, files or mappings,
one QmillError for whatever call fails, and servers that break the contract.

Nothing here imports jax: these tests need only the thin client's dependencies.
"""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import numpy as np
import pytest

from qmill.client import AsyncClient, Client, QmillError, errors, recipes, streaming
from qmill.proto import recipe as recipe_proto
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc


class FakeQuantizer(pb_grpc.QuantizerServicer):
    """Answers each tensor with fixed parts; `mode` makes it misbehave."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.paths: list[str] = []

    def QuantizeParams(self, request_iterator, context):
        for request in request_iterator:
            if request.WhichOneof("item") != "header":
                continue
            self.paths.append(request.header.path)
            qvalue = np.arange(6, dtype=np.int8).reshape(2, 3)
            data = wire.to_bytes(qvalue)
            yield pb.QuantizeParamsResponse(
                result=pb.TensorResult(
                    path=request.header.path,
                    kind=pb.RESULT_KIND_QUANTIZED,
                    how=pb.HowToQuantize(qtype="int8", channelwise_axes=[1]),
                    parts=[wire.header_for("qvalue", qvalue, data)],
                    input_bytes=request.header.byte_length,
                )
            )
            if self.mode == "cut":
                return  # ends mid-tensor: no chunks, no summary
            chunk = next(wire.chunks(data))
            if self.mode == "corrupt":
                chunk = pb.TensorChunk(offset=0, data=b"\x7f" * len(chunk.data))
            yield pb.QuantizeParamsResponse(chunk=chunk)
        if self.mode != "no-summary":
            yield pb.QuantizeParamsResponse(summary=pb.Summary(tensors_received=len(self.paths)))


@pytest.fixture
def fake():
    servicer = FakeQuantizer()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_QuantizerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


TENSORS = [("a", np.ones((2, 3), np.float32)), ("b", np.zeros((2, 3), np.float32))]


def test_outcomes_are_decoded_in_order(fake):
    servicer, address = fake
    with Client(address) as client:
        outcomes = list(client.quantize({"rules": [{"qtype": "int8"}]}, TENSORS))
    assert [o.path for o in outcomes] == ["a", "b"] == servicer.paths
    assert outcomes[0].parts["qvalue"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert outcomes[0].how == {
        "qtype": "int8",
        "channelwise_axes": (1,),
        "tiled_axes": {},
        "calibration_method": "",
    }
    assert outcomes[0].output_bytes == 6


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("cut", "ended before the summary"),
        ("corrupt", "crc32c"),
        ("no-summary", "ended before the summary"),
    ],
)
def test_a_server_that_breaks_the_contract_is_data_loss(fake, mode, message):
    servicer, address = fake
    servicer.mode = mode
    with Client(address) as client, pytest.raises(errors.QmillError) as e:
        list(client.quantize({"rules": [{"qtype": "int8"}]}, TENSORS))
    assert e.value.code == "DATA_LOSS" and message in e.value.details


def test_unreachable_server_is_unavailable():
    with Client("127.0.0.1:1", timeout=5) as client, pytest.raises(errors.QmillError) as e:
        client.capabilities()
    assert e.value.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def test_decoder_handles_zero_byte_parts():
    sent = {"e": np.zeros((0, 4), np.float32)}
    decoder = streaming.ResponseDecoder(sent)
    empty = np.zeros((0, 4), np.int8)
    outcome = decoder.feed(
        pb.QuantizeParamsResponse(
            result=pb.TensorResult(
                path="e", kind=pb.RESULT_KIND_QUANTIZED, parts=[wire.header_for("qvalue", empty)]
            )
        )
    )
    assert outcome is not None and outcome.parts["qvalue"].shape == (0, 4)
    assert sent == {}


class RecordingQuantizer(FakeQuantizer):
    """Also keeps each call's recipe and user agent."""

    def __init__(self) -> None:
        super().__init__()
        self.recipes: list[pb.Recipe] = []
        self.user_agents: list[str] = []

    def QuantizeParams(self, request_iterator, context):
        metadata = dict(context.invocation_metadata())
        self.user_agents.append(metadata.get("user-agent", ""))

        def requests():
            for request in request_iterator:
                if request.WhichOneof("item") == "recipe":
                    self.recipes.append(request.recipe)
                yield request

        yield from super().QuantizeParams(requests(), context)


def _serve(servicer):
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_QuantizerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


AGENT = ("grpc.primary_user_agent", "qmill-test/1")


def test_a_recipe_is_a_preset_name_a_toml_file_or_a_mapping(tmp_path):
    servicer = RecordingQuantizer()
    server, address = _serve(servicer)
    path = tmp_path / "r.toml"
    path.write_text('[[rules]]\npath_regex = ".*"\nqtype = "int4"\ntile_size = 32\n')
    try:
        with Client(address, options=[AGENT]) as client:
            for recipe in ("int4", str(path), path, {"rules": [{"qtype": "int8"}]}):
                assert [o.path for o in client.quantize(recipe, TENSORS)] == ["a", "b"]
            with pytest.raises(ValueError, match="neither a preset"):
                list(client.quantize("int9", TENSORS))

        async def quantize_async():
            async with AsyncClient(address, options=[AGENT]) as client:
                return [o.path async for o in client.quantize("nf4", TENSORS)]

        assert asyncio.run(quantize_async()) == ["a", "b"]
    finally:
        server.stop(0)
    preset, from_str, from_path, mapping, from_async = servicer.recipes
    assert from_async == recipe_proto.from_mapping(recipes.PRESETS["nf4"])
    assert preset == recipe_proto.from_mapping(recipes.PRESETS["int4"])
    assert preset.rules[0].tile_size == 128  # the preset, not the characters of "int4"
    assert from_str == from_path and from_str.rules[0].tile_size == 32
    assert mapping.rules[0].qtype == "int8"
    # options= are appended to the clients' own channel options.
    agents = servicer.user_agents
    assert len(agents) == 5 and all(agent.startswith("qmill-test/1") for agent in agents)


class _Refusing(grpc.GenericRpcHandler):
    """Answers every method of every service with PERMISSION_DENIED, once it has read the
    requests (an asyncio client still writing when the status arrives may see grpc's own
    INTERNAL "Internal error from Core" instead)."""

    def service(self, handler_call_details):
        method = handler_call_details.method.rpartition("/")[2]
        unary_in = method not in ("QuantizeParams", "Calibrate", "Upload")

        def refuse(request_or_iterator, context):
            if not unary_in:
                for _ in request_or_iterator:
                    pass
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "not for you")

        def refuse_stream(request_or_iterator, context):
            refuse(request_or_iterator, context)
            yield  # pragma: no cover

        stream_out = method in ("QuantizeParams", "Calibrate", "ExportOdml", "WatchJob")
        kind = {
            (True, False): grpc.unary_unary_rpc_method_handler,
            (True, True): grpc.unary_stream_rpc_method_handler,
            (False, False): grpc.stream_unary_rpc_method_handler,
            (False, True): grpc.stream_stream_rpc_method_handler,
        }[(unary_in, stream_out)]
        return kind(refuse_stream if stream_out else refuse)


@pytest.fixture
def refusing():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([_Refusing()])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def _every_call(client, tmp_path):
    start = pb.CalibrateStart(model=pb.ModelSpec(name="cnn"), params_upload_id="u")
    return {
        "capabilities": lambda: client.capabilities(),
        "quantize": lambda: list(client.quantize("int8", TENSORS)),
        "upload": lambda: client.upload(b"0123"),
        "quantize_upload": lambda: list(client.quantize_upload("int8", "u")),
        "calibrate": lambda: client.calibrate(start, [np.ones((1, 4), np.float32)]),
        "export_odml": lambda: client.export_odml(pb.ExportOdmlRequest(), tmp_path / "m.tflite"),
        "server_info": lambda: client.server_info(),
        "jobs.submit": lambda: client.jobs.submit("a", "b", "int8"),
        "jobs.get": lambda: client.jobs.get("j"),
        "jobs.list": lambda: client.jobs.list(),
        "jobs.watch": lambda: list(client.jobs.watch("j")),
        "jobs.cancel": lambda: client.jobs.cancel("j"),
    }


def test_every_failed_call_is_one_qmill_error(refusing, tmp_path):
    with Client(refusing, timeout=10) as client:
        for name, call in _every_call(client, tmp_path).items():
            with pytest.raises(QmillError) as e:
                call()
            assert (e.value.code, e.value.details) == ("PERMISSION_DENIED", "not for you"), name
    assert not list(tmp_path.iterdir())


def test_the_async_client_raises_the_same_errors(refusing, tmp_path):
    start = pb.CalibrateStart(model=pb.ModelSpec(name="cnn"), params_upload_id="u")

    async def run():
        codes = {}
        async with AsyncClient(refusing, timeout=10) as client:
            calls = {
                "capabilities": client.capabilities,
                "quantize": lambda: _drain(client.quantize("int8", TENSORS)),
                "upload": lambda: client.upload(b"0123"),
                "quantize_upload": lambda: _drain(client.quantize_upload("int8", "u")),
                "calibrate": lambda: client.calibrate(start, [np.ones((1, 4), np.float32)]),
                "export_odml": lambda: client.export_odml(pb.ExportOdmlRequest(), tmp_path / "m"),
                "server_info": client.server_info,
                "jobs.list": client.jobs.list,
                "jobs.watch": lambda: _drain(client.jobs.watch("j")),
            }
            for name, call in calls.items():
                try:
                    await call()
                except QmillError as e:
                    codes[name] = e.code
        return codes

    codes = asyncio.run(run())
    assert set(codes.values()) == {"PERMISSION_DENIED"} and len(codes) == 9


async def _drain(items):
    return [item async for item in items]


class FakeExporter(pb_grpc.OdmlExporterServicer):
    """Streams MODEL back, announced with `crc` (the right one unless a test spoils it)."""

    MODEL = bytes(range(256)) * 40

    def __init__(self) -> None:
        self.crc = wire.crc32c(self.MODEL)

    def ExportOdml(self, request, context):
        info = pb.OdmlModelInfo(byte_length=len(self.MODEL), crc32c=self.crc, ops=["ADD"])
        yield pb.ExportOdmlResponse(info=info)
        for chunk in wire.chunks(np.frombuffer(self.MODEL, np.uint8), 4096):
            yield pb.ExportOdmlResponse(chunk=chunk)


def test_an_exported_model_is_written_only_when_its_bytes_check_out(tmp_path):
    servicer = FakeExporter()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_OdmlExporterServicer_to_server(servicer, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        with Client(address) as client:
            result = client.export_odml(pb.ExportOdmlRequest(), tmp_path / "m.tflite")
            assert result.path.read_bytes() == FakeExporter.MODEL and list(result.info.ops) == [
                "ADD"
            ]
            servicer.crc ^= 1
            with pytest.raises(QmillError) as e:
                client.export_odml(pb.ExportOdmlRequest(), tmp_path / "bad.tflite")
    finally:
        server.stop(0)
    assert e.value.code == "DATA_LOSS" and "crc32c" in e.value.details
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.tflite"]
