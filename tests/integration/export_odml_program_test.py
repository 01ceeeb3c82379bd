"""ExportOdml from a program: an NNX model with two inputs that no registry knows, calibrated
remotely, traced on the client under the ODML conversion provider, converted by the server; the
.tflite runs in LiteRT within one output quantization step of the JAX PTQ model."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

import qmill.engine as qe
from qmill.client import Client, errors
from qmill.client import programs as client_programs
from qmill.engine.programs import build as program_build
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import params as params_lib
from tests.integration.calibrate_program_test import RULES, TwoInputs

pytest.importorskip("litert_converter", reason="ExportOdml needs the qmill[odml] extra")


def _data(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 12)).astype(np.float32), rng.uniform(size=(n, 3)).astype(np.float32)


def _litert(tflite: bytes, x: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, float]:
    """Outputs one example at a time, and the int8 output's scale (one quantization step)."""
    from ai_edge_litert.interpreter import Interpreter

    it = Interpreter(model_content=tflite)
    it.allocate_tensors()
    inputs = sorted(it.get_input_details(), key=lambda d: d["name"])  # input_0, input_1
    out = it.get_output_details()[0]
    got = []
    for i in range(len(x)):
        it.set_tensor(inputs[0]["index"], x[i : i + 1])
        it.set_tensor(inputs[1]["index"], m[i : i + 1])
        it.invoke()
        got.append(it.get_tensor(out["index"])[0].copy())
    int8_outputs = [
        t for t in it.get_tensor_details()
        if t["dtype"] == np.int8 and len(t["quantization_parameters"]["scales"]) == 1
        and t["shape"].tolist() == out["shape"].tolist()
    ]  # fmt: skip
    assert int8_outputs, "no int8 output tensor before the final DEQUANTIZE"
    return np.stack(got), float(int8_outputs[-1]["quantization_parameters"]["scales"][0])


@pytest.fixture(scope="module")
def client(make_server):
    with Client(make_server().address) as c:
        yield c


def test_program_export_runs_in_litert_like_the_jax_ptq_model(client, tmp_path) -> None:
    model = TwoInputs(nnx.Rngs(3))
    # Calibration batches as large as a user's (the output's range is the mean of per-batch
    # absmax: small batches give a range that clips more test outputs, which the float output of
    # the JAX PTQ model never does); then 256 held-out examples.
    x, m = _data(1280, seed=4)
    batches = [(x[i : i + 256], m[i : i + 256]) for i in range(0, 1024, 256)]
    program, floats = program_build.calibration_program(model, RULES, *batches[0])
    upload = client.upload(safetensors.numpy.save(floats))
    cal = client.calibrate(
        pb.CalibrateStart(program=program, params_upload_id=upload.upload_id), batches
    )
    stats = params_lib.unflatten(cal.stats)

    artifact = program_build.export_program(model, RULES, x[:1], m[:1], quant_stats=stats)
    result = client.export_odml(pb.ExportOdmlRequest(program=artifact), tmp_path / "m.tflite")
    assert result.info.quantized_weights["INT8"] == 3
    assert result.info.ops[0] == "QUANTIZE" and result.info.ops[-1] == "DEQUANTIZE"
    got, step = _litert((tmp_path / "m.tflite").read_bytes(), x[1024:], m[1024:])

    # The JAX static-range PTQ model from the same float params and the server's statistics.
    stats.pop("final_output0")
    ptq = qe.quantize_model(model, qe.PtqProvider(RULES), x[:1], m[:1])
    float_params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    nnx.update(ptq, qe.quantize_params(float_params, ptq, jax.tree.map(np.asarray, stats)))
    ref = np.asarray(ptq(x[1024:], m[1024:]))
    # Within one step of the output's int8 scale (LiteRT rounds the output to it; 1e-4 covers
    # the float32 rounding of the step itself) on >= 99 % of the examples.
    within = np.all(np.abs(got - ref) <= step * 1.0001, axis=-1)
    assert within.mean() >= 0.99, within.mean()


@pytest.mark.parametrize("case", ["calibrate-kind", "malformed", "with-model"])
def test_bad_export_programs_are_invalid_argument(client, tmp_path, case) -> None:
    model = TwoInputs(nnx.Rngs(0))
    x, m = _data(2, seed=0)
    weight_only = [qe.QuantizationRule(weight_qtype="int8")]
    artifact = program_build.export_program(model, weight_only, x[:1], m[:1])
    request = pb.ExportOdmlRequest(program=artifact)
    if case == "calibrate-kind":
        request.program = program_build.calibration_program(model, RULES, x, m)[0]
    elif case == "malformed":
        request.program = artifact[:50]
    else:
        request.model.name = "cnn"
    with pytest.raises(errors.QmillError) as exc:
        client.export_odml(request, tmp_path / "bad.tflite")
    assert exc.value.code == "INVALID_ARGUMENT", exc.value.details
    assert not (tmp_path / "bad.tflite").exists()
    # The server keeps serving (here the program travels as an upload).
    uploaded = client_programs.upload_program(client, artifact)
    request = pb.ExportOdmlRequest(program_upload_id=uploaded)
    ok = client.export_odml(request, tmp_path / "ok.tflite")
    assert ok.info.quantized_weights["INT8"] == 3
