"""The edge-deployment path as a user runs it, through a real server and its real stores:
`qmill calibrate --params CKPT` (uploads the checkpoint), `qmill export-odml --params CKPT`
(the same bytes, not sent again) with the calibration id, then the .tflite in LiteRT's
interpreter against the JAX static-range PTQ model made from the same params and statistics."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import numpy as np
import pytest

import qmill.engine as qe
from qmill.engine import zoo
from qmill.server import params as params_lib
from tests import digits_data, litert_run

_spec = importlib.util.spec_from_file_location(
    "qmill_digits_helpers",
    pathlib.Path(__file__).parents[1] / "engine" / "providers" / "digits_test.py",
)
digits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(digits)

W8A8 = [qe.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The registry's `cnn` trained on digits, saved as a training script would (npz)."""
    tmp = tmp_path_factory.mktemp("odml-cli")
    x, y = digits_data.shuffled()
    model = zoo.BUILTIN["cnn"].build(zoo.CnnConfig())
    params = digits._train(
        model, model.init(jax.random.key(0), x[:1]), x[:1400], y[:1400], epochs=3, lr=3e-3
    )["params"]
    flat = {
        f"params/{layer}/{name}": np.asarray(v)
        for layer, leaves in params.items()
        for name, v in leaves.items()
    }
    np.savez(tmp / "cnn.npz", **flat)
    np.save(tmp / "calibration.npy", x[:600])
    return tmp, params, (x[1400:], y[1400:])


def test_calibrate_then_export_w8a8_runs_in_litert_like_the_jax_ptq_model(
    make_server, trained, run_qmill
):
    tmp, params, (xt, yt) = trained
    address = make_server(data_dir=str(tmp / "data")).address
    cal = run_qmill(
        "calibrate", "--server", address, "--model", "cnn", "--params", str(tmp / "cnn.npz"),
        "--batches", str(tmp / "calibration.npy"), "--batch-size", "200",
        "--rules", "w8a8-static", "--stats-output", str(tmp / "stats.npz"),
    )  # fmt: skip
    assert cal.returncode == 0, cal.stderr
    calibration_id = cal.stdout.split("calibration ", 1)[1].split(":", 1)[0]

    out = tmp / "cnn.tflite"
    export = run_qmill(
        "export-odml", "--server", address, "--model", "cnn", "--config", "{}",
        "--params", str(tmp / "cnn.npz"), "--calibration-id", calibration_id,
        "--rules", "w8a8", "-o", str(out),
    )  # fmt: skip
    assert export.returncode == 0, export.stderr
    assert "already on the server, none sent" in export.stdout  # uploaded once, by calibrate
    assert "weights: INT8 4" in export.stdout
    ops = export.stdout.split("ops: ", 1)[1].split()
    assert ops[0] == "QUANTIZE" and ops[-1] == "DEQUANTIZE" and "CONV_2D" in ops

    interpreter = litert_run.interpreter(out.read_bytes())
    got = litert_run.outputs(interpreter, xt)

    # The JAX static-range PTQ model from the same params and the server's merged statistics.
    with np.load(tmp / "stats.npz") as f:
        stats = params_lib.unflatten({k: f[k] for k in f.files})
    stats.pop("final_output0", None)
    ptq = qe.quantize_model(zoo.BUILTIN["cnn"].build(zoo.CnnConfig()), qe.PtqProvider(W8A8))
    abstract = jax.eval_shape(ptq.init, jax.random.key(0), xt[:1])
    ptq_params = qe.quantize_params(params, abstract["params"], stats)
    ref = np.asarray(jax.jit(ptq.apply)({"params": ptq_params}, xt))

    ref_acc = np.mean(ref.argmax(-1) == yt) * 100
    acc = np.mean(got.argmax(-1) == yt) * 100
    assert ref_acc > 90, ref_acc
    assert abs(acc - ref_acc) <= 1.0, (acc, ref_acc)
    # Outputs agree within one step of the output's int8 scale on >= 99 % of the examples.
    detail = interpreter.get_output_details()[0]
    dequantize_input = [
        t for t in interpreter.get_tensor_details()
        if t["dtype"] == np.int8 and len(t["quantization_parameters"]["scales"]) == 1
        and t["shape"].tolist() == detail["shape"].tolist()
    ]  # fmt: skip
    assert dequantize_input, "no int8 output tensor before the final DEQUANTIZE"
    step = float(dequantize_input[-1]["quantization_parameters"]["scales"][0])
    within = np.all(np.abs(got - ref) <= step * 1.0001, axis=-1)
    assert within.mean() >= 0.99, within.mean()
