"""LiteRT export of the digits CNN, checked by running the .tflite and reading the flatbuffer."""

import builtins
import importlib.util
import itertools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qmill.engine as qe
from qmill.engine.providers import odml
from qmill.server.odml import export as odml_export
from tests import digits_data, litert_run

_spec = importlib.util.spec_from_file_location(
    "qmill_digits_helpers",
    pathlib.Path(__file__).parents[2] / "engine" / "providers" / "digits_test.py",
)
digits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(digits)

INPUT = jax.ShapeDtypeStruct((1, 8, 8, 1), jnp.float32)
W8A8 = [qe.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]


@pytest.fixture(scope="module")
def trained():
    x, y = digits_data.shuffled()
    model = digits.CNN()
    variables = digits._train(
        model, model.init(jax.random.key(0), x[:1]), x[:1400], y[:1400], epochs=3, lr=3e-3
    )
    return variables["params"], (x[:1400], y[:1400]), (x[1400:], y[1400:])


def _calibrate(params, x):
    qat = qe.quantize_model(digits.CNN(), qe.OdmlQatProvider(W8A8))
    stats = qat.init(jax.random.key(0), x[:1])["quant_stats"]
    step = jax.jit(
        lambda s, xb: qat.apply({"params": params, "quant_stats": s}, xb, mutable=["quant_stats"])
    )
    for i in range(0, len(x), 200):
        stats = step(stats, x[i : i + 200])[1]["quant_stats"]
    return stats


def _ptq_logits(rules, params, stats, x):
    ptq = qe.quantize_model(digits.CNN(), qe.PtqProvider(rules))
    abstract = jax.eval_shape(ptq.init, jax.random.key(0), x[:1])
    op_stats = {k: v for k, v in (stats or {}).items() if k != odml.MODEL_OUTPUT}
    ptq_params = qe.quantize_params(params, abstract["params"], op_stats)
    return np.asarray(jax.jit(ptq.apply)({"params": ptq_params}, x))


def _run_tflite(tflite: bytes, x: np.ndarray) -> np.ndarray:
    return litert_run.outputs(litert_run.interpreter(tflite), x)


def _tensors(tflite: bytes):
    """(type name, shape, scales, values or None) of every quantized tensor."""
    from ai_edge_litert import schema_py_generated as schema
    from ai_edge_litert.tools import flatbuffer_utils

    model = flatbuffer_utils.read_model_from_bytearray(bytearray(tflite))
    names = {v: k for k, v in vars(schema.TensorType).items() if not k.startswith("_")}
    out = []
    for t in model.subgraphs[0].tensors:
        q = t.quantization
        if q is None or q.scale is None or len(q.scale) == 0:
            continue
        data = model.buffers[t.buffer].data
        values = None
        if data is not None and len(data):
            raw = np.asarray(data, np.uint8)
            if names[t.type] == "INT4":  # two values per byte, the first in the low nibble
                nib = np.stack([raw & 0xF, raw >> 4], -1).reshape(-1)[: np.prod(t.shape)]
                values = np.where(nib > 7, nib.astype(np.int16) - 16, nib).astype(np.int8)
            elif names[t.type] == "INT8":
                values = raw.view(np.int8)
            if values is not None:
                values = values.reshape(t.shape)
        out.append((names[t.type], tuple(t.shape), np.asarray(q.scale, np.float32), values))
    return out


def _same_up_to_layout(values: np.ndarray, qvalue: np.ndarray) -> bool:
    for perm in itertools.permutations(range(qvalue.ndim)):
        moved = np.transpose(qvalue, perm)
        if moved.size == values.size and np.array_equal(moved.reshape(values.shape), values):
            return True
    return False


def _check_weights(tflite, info, storage):
    tensors = _tensors(tflite)
    weights = [r for r in info.fake_quants if r.kind == "weight"]
    assert len(weights) == 4
    for rec in weights:
        # The tensor with qmill's per-channel scales holds qmill's integer values.
        match = [t for t in tensors if t[3] is not None and np.array_equal(t[2], rec.scale)]
        assert len(match) == 1, rec.name
        kind, _, _, values = match[0]
        assert kind == storage
        assert _same_up_to_layout(values, rec.qvalue), rec.name
    return tensors


def test_static_range_w8a8_runs_with_qmills_scales(trained):
    params, (x, _), (xt, yt) = trained
    stats = _calibrate(params, x)
    tflite, info = odml_export.export_tflite(digits.CNN(), params, W8A8, stats, INPUT)
    assert info.ops[0] == "QUANTIZE" and info.ops[-1] == "DEQUANTIZE"
    assert "DEQUANTIZE" not in info.ops[:-1]  # integer from the first op to the last
    assert info.quantized_weights == {"INT8": 4}
    tensors = _check_weights(tflite, info, "INT8")
    # Activations: int8 with the calibrated scales, each op input and the model output.
    acts = [r for r in info.fake_quants if r.kind in ("activation", "output")]
    assert len(acts) == 5
    act_scales = {float(t[2][0]) for t in tensors if t[3] is None and t[0] == "INT8"}
    assert act_scales == {float(r.scale[0]) for r in acts}

    ref = _ptq_logits(W8A8, params, stats, xt)
    got = _run_tflite(tflite, xt)
    ref_acc = np.mean(ref.argmax(-1) == yt) * 100
    acc = np.mean(got.argmax(-1) == yt) * 100
    assert ref_acc > 90
    assert abs(acc - ref_acc) <= 1.0, (acc, ref_acc)
    step = next(r for r in info.fake_quants if r.kind == "output").scale[0]
    within = np.all(np.abs(got - ref) <= step * 1.0001, axis=-1)
    assert within.mean() >= 0.99, within.mean()


@pytest.mark.parametrize(("qtype", "storage"), [("int8", "INT8"), ("int4", "INT4")])
def test_weight_only_carries_qmills_values(trained, qtype, storage):
    params, _, (xt, yt) = trained
    rules = [qe.QuantizationRule(weight_qtype=qtype)]
    tflite, info = odml_export.export_tflite(digits.CNN(), params, rules, None, INPUT)
    assert info.quantized_weights == {storage: 4}
    _check_weights(tflite, info, storage)
    ref = _ptq_logits(rules, params, None, xt)
    got = _run_tflite(tflite, xt)
    # Float compute on qmill's dequantized weights: the PTQ model's outputs to rounding error.
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)
    assert abs(np.mean(got.argmax(-1) == yt) - np.mean(ref.argmax(-1) == yt)) * 100 <= 1.0


def test_rules_litert_cannot_store_are_refused(trained):
    params, _, _ = trained
    rules = [qe.QuantizationRule(weight_qtype="int8", tile_size=16)]
    with pytest.raises(odml.LiteRtUnsupported, match="tile_size"):
        odml_export.export_tflite(digits.CNN(), params, rules, None, INPUT)


def test_without_the_extra_the_error_names_it(monkeypatch):
    real_import = builtins.__import__

    def no_litert(name, *args, **kwargs):
        if name.startswith(("litert_converter", "ai_edge_litert")):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_litert)
    with pytest.raises(odml_export.OdmlUnavailable, match=r"qmill\[odml\]"):
        odml_export.export_tflite(digits.CNN(), {}, [], None, INPUT)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    available, reason = odml_export.availability()
    assert not available and "qmill[odml]" in reason
