"""ExportOdml over a real gRPC server on 127.0.0.1, and the `qmill export-odml` command.

The model registry and the upload / calibration stores are another part's; here the servicer gets
in-memory Backends holding a trained digits CNN, its params and its calibration.
"""

import asyncio
import importlib.util
import pathlib
import threading
from concurrent import futures

import grpc
import jax
import pytest

import qmill.engine as qe
from qmill.cli import export_odml as cli_export
from qmill.cli import main as cli
from qmill.client import Client, errors
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc
from qmill.server.odml import export as odml_export
from qmill.server.odml import servicer as odml_servicer
from tests import digits_data

_spec = importlib.util.spec_from_file_location(
    "qmill_digits_helpers",
    pathlib.Path(__file__).parents[1] / "engine" / "providers" / "digits_test.py",
)
digits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(digits)


@pytest.fixture(scope="module")
def trained():
    x, y = digits_data.images(), digits_data.labels()
    model = digits.CNN()
    params = digits._train(
        model, model.init(jax.random.key(0), x[:1]), x[:1400], y[:1400], epochs=2, lr=3e-3
    )["params"]
    rules = [qe.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]
    qat = qe.quantize_model(digits.CNN(), qe.OdmlQatProvider(rules))
    stats = qat.init(jax.random.key(0), x[:1])["quant_stats"]
    _, upd = qat.apply({"params": params, "quant_stats": stats}, x[:700], mutable=["quant_stats"])
    return params, upd["quant_stats"], (x[1400:], y[1400:])


@pytest.fixture(scope="module")
def address(trained):
    params, stats, _ = trained

    def resolve(spec):
        if spec.name != "cnn":
            raise LookupError(f"no model {spec.name!r}; known: cnn")
        return digits.CNN()

    def load(store, what):
        def get(tenant, key):
            if (tenant, key) not in store:
                raise LookupError(f"no {what} {key!r}")
            return store[(tenant, key)]

        return get

    backends = odml_servicer.Backends(
        resolve_model=resolve,
        load_params=load({("default", "up-1"): params}, "upload"),
        load_stats=load({("default", "cal-1"): stats}, "calibration"),
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    executor = futures.ThreadPoolExecutor(2)

    async def start():
        server = grpc.aio.server()
        pb_grpc.add_OdmlExporterServicer_to_server(
            odml_servicer.OdmlExporterServicer(executor, backends), server
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    yield f"127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(server.stop(0.5), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()  # else its ResourceWarning, raised whenever GC finds it, fails a later test
    executor.shutdown()


def _request(**fields):
    base = {
        "model": pb.ModelSpec(name="cnn"),
        "params_upload_id": "up-1",
        "rules": cli_export.PRESETS["w8a8"],
        "calibration_id": "cal-1",
        "input_shape": [1, 8, 8, 1],
        "input_dtype": pb.DTYPE_F32,
    }
    return pb.ExportOdmlRequest(**(base | fields))


def _export(address, request, out):
    with Client(address) as client:
        return client.export_odml(request, out)


def test_w8a8_model_streams_back_and_runs(address, trained, tmp_path):
    from ai_edge_litert.interpreter import Interpreter

    result = _export(address, _request(), tmp_path / "cnn.tflite")
    data = result.path.read_bytes()
    assert len(data) == result.info.byte_length
    assert result.info.quantized_weights == {"INT8": 4}
    assert result.info.ops[0] == "QUANTIZE" and "CONV_2D" in result.info.ops
    assert not list(tmp_path.glob("*.partial"))
    _, _, (xt, yt) = trained
    interpreter = Interpreter(model_content=data)
    interpreter.allocate_tensors()
    inp = interpreter.get_input_details()[0]["index"]
    out = interpreter.get_output_details()[0]["index"]
    correct = 0
    for i in range(len(xt)):
        interpreter.set_tensor(inp, xt[i : i + 1])
        interpreter.invoke()
        correct += int(interpreter.get_tensor(out)[0].argmax() == yt[i])
    assert correct / len(xt) > 0.9


@pytest.mark.parametrize(
    ("fields", "code", "text"),
    [
        ({"calibration_id": ""}, "FAILED_PRECONDITION", "calibration_id"),
        ({"model": pb.ModelSpec(name="resnet")}, "NOT_FOUND", "resnet"),
        ({"params_upload_id": "up-2"}, "NOT_FOUND", "up-2"),
        ({"rules": [pb.ModelRule(weight_qtype="int8", tile_size=16)]}, "FAILED_PRECONDITION", ""),
        ({"rules": [pb.ModelRule(weight_qtype="bogus")]}, "INVALID_ARGUMENT", "rules[0]"),
        ({"input_shape": []}, "INVALID_ARGUMENT", "input_shape"),
    ],
)
def test_bad_requests_get_a_status_and_the_fix(address, tmp_path, fields, code, text):
    with pytest.raises(errors.QmillError) as info:
        _export(address, _request(**fields), tmp_path / "x.tflite")
    assert info.value.code == code and text in info.value.details
    assert not list(tmp_path.iterdir())


def test_without_the_extra_the_server_answers_unimplemented(address, tmp_path, monkeypatch):
    reason = f"{odml_export.INSTALL_HINT} (missing: litert_converter)"
    monkeypatch.setattr(odml_export, "availability", lambda: (False, reason))
    with pytest.raises(errors.QmillError) as info:
        _export(address, _request(), tmp_path / "x.tflite")
    assert info.value.code == "UNIMPLEMENTED" and "qmill[odml]" in info.value.details


def test_cli_writes_the_model(address, tmp_path, capsys):
    out = tmp_path / "int4.tflite"
    argv = ["export-odml", "--server", address, "--model", "cnn", "--params-upload-id", "up-1"]
    assert cli.main([*argv, "--rules", "int4", "-o", str(out)]) == 0
    assert "INT4 4" in capsys.readouterr().out
    assert out.stat().st_size > 0
    assert cli.main([*argv, "--rules", "w8a8", "-o", str(tmp_path / "no.tflite")]) == 1
    assert "calibration_id" in capsys.readouterr().err


def test_default_server_reports_odml_and_names_an_unknown_upload(server, tmp_path):
    with grpc.insecure_channel(server.address) as channel:
        caps = pb_grpc.QuantizerStub(channel).GetCapabilities(pb.GetCapabilitiesRequest())
        assert caps.odml_available and not caps.odml_unavailable_reason
        with pytest.raises(errors.QmillError) as info:
            _export(server.address, _request(), tmp_path / "x.tflite")
    # The real registry knows "cnn"; the upload id was never uploaded.
    assert info.value.code == "NOT_FOUND"
    assert "up-1" in info.value.details
    assert not (tmp_path / "x.tflite").exists()
