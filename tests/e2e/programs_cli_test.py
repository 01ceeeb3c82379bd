"""A model no registry knows, through the CLI as a user runs it: examples/digits_cnn.py (a Linen
CNN) trained on the digits data, `qmill export-program`, `qmill calibrate --artifact` with
--ptq-output (static-range params from QuantizeParams), `qmill export-odml --model-fn`.

The SRQ params equal local SRQ with the same batches (tests/srq_equal.py); the .tflite runs in
LiteRT within one output quantization step of the JAX PTQ model on >= 99 % of held-out examples.
"""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import numpy as np
import pytest

import qmill.engine as qe
from qmill import checkpoints
from qmill.engine.programs import program as programs
from tests import digits_data, litert_run, srq_equal

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "digits_cnn.py"
W8A8 = [qe.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]


def _module(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    digits = _module(ROOT / "tests" / "engine" / "providers" / "digits_test.py", "digits_h")
    example = _module(EXAMPLE, "digits_cnn_example")
    tmp = tmp_path_factory.mktemp("programs-cli")
    x, y = digits_data.shuffled()
    model = example.DigitsCnn()
    variables = {"params": example.init_params()}
    params = digits._train(model, variables, x[:1200], y[:1200], epochs=2, lr=3e-3)["params"]
    flat = programs.flat_paths(jax.tree.map(np.asarray, params))
    np.savez(tmp / "cnn.npz", **{f"params/{k}": v for k, v in flat.items()})
    np.save(tmp / "calibration.npy", x[:600])
    return tmp, model, params, x, y


def _local_srq(model, params, batches) -> dict[str, np.ndarray]:
    """QT stats (jitted, batch after batch) -> PtqProvider's quantize_params."""
    qt_model = qe.quantize_model(model, qe.QtProvider(W8A8))
    stats = qt_model.init(jax.random.key(0), batches[0])["quant_stats"]
    step = jax.jit(lambda v, b: qt_model.apply(v, b, mutable=["quant_stats"])[1]["quant_stats"])
    for batch in batches:
        stats = step({"params": params, "quant_stats": stats}, batch)
    ptq = qe.quantize_model(model, qe.PtqProvider(W8A8))
    abstract = jax.eval_shape(ptq.init, jax.random.key(0), batches[0])
    tree = qe.quantize_params(params, abstract["params"], stats)
    return programs.flat_paths(jax.tree.map(np.asarray, tree)), ptq, tree


def test_calibrate_srq_and_export_through_the_cli(make_server, trained, run_qmill) -> None:
    tmp, model, params, x, y = trained
    address = make_server(data_dir=str(tmp / "data")).address
    made = run_qmill(
        "export-program", "--model-fn", f"{EXAMPLE}:build", "--params", str(tmp / "cnn.npz"),
        "--batch-size", "200", "-o", str(tmp / "cal.qprog"),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    cal = run_qmill(
        "calibrate", "--server", address, "--artifact", str(tmp / "cal.qprog"), "--params",
        str(tmp / "cnn.npz"), "--batches", str(tmp / "calibration.npy"), "--stats-output",
        str(tmp / "stats.npz"), "--ptq-output", str(tmp / "ptq.safetensors"),
    )  # fmt: skip
    assert cal.returncode == 0, cal.stderr
    assert "3 batches, 600 examples in total" in cal.stdout

    want, ptq, ptq_params = _local_srq(model, params, np.split(x[:600], 3))
    with checkpoints.open_source(tmp / "ptq.safetensors") as source:
        got = {e.path: source.read(e.path) for e in source.entries()}
    srq_equal.assert_srq_equal(got, want)

    out = tmp / "digits.tflite"
    export = run_qmill(
        "export-odml", "--server", address, "--model-fn", f"{EXAMPLE}:build", "--params",
        str(tmp / "cnn.npz"), "--stats", str(tmp / "stats.npz"), "--rules", "w8a8", "-o", str(out),
    )  # fmt: skip
    assert export.returncode == 0, export.stderr
    assert "weights: INT8 3" in export.stdout

    interpreter = litert_run.interpreter(out.read_bytes())
    xt, yt = x[1200:], y[1200:]
    got_out = litert_run.outputs(interpreter, xt)
    ref = np.asarray(jax.jit(ptq.apply)({"params": ptq_params}, xt))
    assert np.mean(ref.argmax(-1) == yt) > 0.85
    detail = interpreter.get_output_details()[0]
    int8_outputs = [
        t for t in interpreter.get_tensor_details()
        if t["dtype"] == np.int8 and len(t["quantization_parameters"]["scales"]) == 1
        and t["shape"].tolist() == detail["shape"].tolist()
    ]  # fmt: skip
    step = float(int8_outputs[-1]["quantization_parameters"]["scales"][0])
    # One step of the output's int8 scale (1e-4 covers the float32 rounding of the step itself).
    within = np.all(np.abs(got_out - ref) <= step * 1.0001, axis=-1)
    assert within.mean() >= 0.99, within.mean()


def test_program_errors_print_one_line(make_server, trained, run_qmill) -> None:
    tmp = trained[0]
    address = make_server(data_dir=str(tmp / "data2")).address
    (tmp / "junk.qprog").write_bytes(b"QMILLPRG\x01\n\x02\x00\x00\x00{}junk")
    cases = [
        (["--artifact", str(tmp / "junk.qprog")], "not a calibrate program (kind None)"),
        (["--model-fn", "no_such_module:build"], "No module named 'no_such_module'"),
    ]
    for args, message in cases:
        result = run_qmill(
            "calibrate", "--server", address, *args, "--params", str(tmp / "cnn.npz"),
            "--batches", str(tmp / "calibration.npy"),
        )  # fmt: skip
        assert result.returncode == 1, result.stdout
        assert result.stderr.startswith("qmill: error:") and message in result.stderr
        assert "Traceback" not in result.stderr
