"""A qmill checkpoint loaded back runs the seeds' PTQ models exactly as `quantize_params` does.

The MLP of the get-started page (seed 004) in Linen and NNX, with the PTQ page's (seed 003)
rules in int8 and int4. Float params are saved as a checkpoint, quantized by qmill -- the CLI,
the in-process engine, a real server on 127.0.0.1 -- into each format, and loaded with
`checkpoints.load`: the models' outputs are bit-identical to those from in-process
`quantize_params` (the same params reach the same compiled computation), and so are the params.
Remote static-range (SRQ) PTQ params from Calibrate load the same way, activation scales
included.
"""

from __future__ import annotations

import json
import os
import subprocess

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from flax import linen as nn
from flax import nnx

import qmill.engine as qwix  # the seeds' samples are written against `qwix`
from qmill import checkpoints
from qmill.checkpoints.loading import loader
from qmill.checkpoints.run import embedded, pipeline
from qmill.client import Client
from qmill.client import calibrate as client_calibrate
from qmill.engine import zoo
from qmill.proto.v1 import qmill_pb2 as pb
from tests import random_inputs
from tests.e2e import processes
from tests.engine.seed_models import LinenMLP, NnxMLP

SUFFIX = {"orbax": "", "safetensors": ".safetensors", "npz": ".npz"}
MODEL_INPUT = random_inputs.uniform(jax.random.key(0), (8, 16))


def _rules(qtype: str) -> list:
    return [qwix.QuantizationRule(module_path=".*", weight_qtype=qtype, act_qtype="int8")]


def _recipe(qtype: str) -> dict:
    """The qmill recipe that quantizes weights as the PtqProvider rule does: Flax kernels
    (in, out), absmax per output channel, no tiles."""
    return {"convention": "flax", "rules": [{"path_regex": ".*", "qtype": qtype}]}


def _linen():
    model = LinenMLP(64, 16)
    return model, model.init(jax.random.key(1), MODEL_INPUT)["params"]


def _nnx_fp_params():
    return nnx.to_pure_dict(nnx.state(NnxMLP(16, 64, 16, rngs=nnx.Rngs(1)), nnx.Param))


def _flat(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = np.asarray(value)
    return out


@pytest.fixture(scope="module")
def fp_checkpoint(tmp_path_factory):
    """Both models' float params in one npz: linen/Dense_0/kernel ..., nnx/linear1/kernel ..."""
    path = tmp_path_factory.mktemp("fp") / "fp.npz"
    tree = {"linen": dict(_linen()[1]), "nnx": _nnx_fp_params()}
    np.savez(path, **_flat(tree))
    return path


def _assert_same_params(loaded, expected):
    flat_loaded, flat_expected = _flat(loaded), _flat(expected)
    assert flat_loaded.keys() == flat_expected.keys()
    for key, value in flat_expected.items():
        assert flat_loaded[key].dtype == value.dtype, key
        assert flat_loaded[key].tobytes() == value.tobytes(), key


def _check_linen(tree, qtype):
    model, fp_params = _linen()
    ptq_model = qwix.quantize_model(model, qwix.PtqProvider(_rules(qtype)))
    abs_ptq_variables = jax.eval_shape(ptq_model.init, jax.random.key(0), MODEL_INPUT)
    ptq_params = qwix.quantize_params(fp_params, abs_ptq_variables["params"])
    loaded = loader.fill(abs_ptq_variables["params"], tree)
    assert isinstance(loaded["Dense_0"]["kernel"], qwix.WithAux)
    assert loaded["Dense_0"]["kernel"].array.qvalue.dtype.name == qtype
    _assert_same_params(jax.tree.map(np.asarray, loaded), jax.tree.map(np.asarray, ptq_params))
    expected = ptq_model.apply({"params": ptq_params}, MODEL_INPUT)
    got = ptq_model.apply({"params": loaded}, MODEL_INPUT)
    assert np.asarray(got).tobytes() == np.asarray(expected).tobytes()


def _check_nnx(tree, qtype):
    def create_quantized_model():
        fp_model = NnxMLP(16, 64, 16, rngs=nnx.Rngs(0))
        return qwix.quantize_model(fp_model, qwix.PtqProvider(_rules(qtype)), MODEL_INPUT)

    abs_ptq_model = nnx.eval_shape(create_quantized_model)
    ptq_params = qwix.quantize_params(_nnx_fp_params(), abs_ptq_model)
    _assert_same_params(tree, ptq_params)
    reference = nnx.eval_shape(create_quantized_model)
    nnx.update(reference, ptq_params)
    nnx.update(abs_ptq_model, tree)
    expected, got = reference(MODEL_INPUT), abs_ptq_model(MODEL_INPUT)
    assert np.asarray(got).tobytes() == np.asarray(expected).tobytes()


def _check(path, qtype):
    tree = checkpoints.load(path, as_jax=True)
    assert set(tree) == {"linen", "nnx"}
    _check_linen(tree["linen"], qtype)
    _check_nnx(tree["nnx"], qtype)


@pytest.mark.parametrize("qtype", ["int8", "int4"])
@pytest.mark.parametrize("fmt", sorted(SUFFIX))
def test_embedded_output_loads_into_the_ptq_models(fp_checkpoint, tmp_path, fmt, qtype):
    out = tmp_path / f"q{SUFFIX[fmt]}"
    pipeline.quantize_checkpoint(
        fp_checkpoint, out, _recipe(qtype), backend=embedded.EmbeddedClient(), output_format=fmt
    )
    _check(out, qtype)


@pytest.mark.parametrize(
    ("fmt", "qtype"), [("orbax", "int4"), ("safetensors", "int8"), ("npz", "int4")]
)
def test_remote_output_loads_into_the_ptq_models(server, fp_checkpoint, tmp_path, fmt, qtype):
    out = tmp_path / f"q{SUFFIX[fmt]}"
    with Client(server.address) as client:
        pipeline.quantize_checkpoint(
            fp_checkpoint, out, _recipe(qtype), backend=client, output_format=fmt
        )
    _check(out, qtype)


@pytest.mark.parametrize(
    ("fmt", "qtype"), [("orbax", "int8"), ("safetensors", "int4"), ("npz", "int8")]
)
def test_cli_output_loads_into_the_ptq_models(fp_checkpoint, tmp_path, fmt, qtype):
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f'convention = "flax"\n[[rules]]\npath_regex = ".*"\nqtype = "{qtype}"\n')
    out = tmp_path / f"q{SUFFIX[fmt]}"
    args = [str(fp_checkpoint), "-o", str(out), "--format", fmt, "--recipe", str(recipe), "-q"]
    run = subprocess.run(
        [*processes.qmill(), "quantize", *args],
        capture_output=True, text=True, timeout=300, env=os.environ,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    _check(out, qtype)


def test_a_sharded_safetensors_output_loads_as_one_tree(tmp_path):
    qvalue = np.arange(-8, 7, dtype=np.int8).reshape(3, 5).astype(ml_dtypes.int4)
    with checkpoints.create_writer(tmp_path / "sharded", "safetensors", max_shard_bytes=16) as w:
        w.write_quantized("model.layers.0.w", {"qvalue": qvalue, "scale": np.ones((1, 5))})
        w.write("model.norm", np.ones(4, np.float32))
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) == 3
    tree = checkpoints.load(tmp_path / "sharded")
    assert set(tree) == {"model.layers.0.w", "model.norm"}  # a safetensors name keeps its dots
    assert tree["model.layers.0.w"]["array"]["qvalue"].tobytes() == qvalue.tobytes()
    assert isinstance(tree["model.norm"], np.ndarray)
    cpu = jax.devices("cpu")[0]
    on_device = checkpoints.load(tmp_path / "sharded", device=cpu)
    qvalue_on_device = on_device["model.layers.0.w"]["array"]["qvalue"]
    assert isinstance(qvalue_on_device, jax.Array) and qvalue_on_device.devices() == {cpu}
    assert np.asarray(qvalue_on_device).tobytes() == qvalue.tobytes()


def test_a_checkpoint_that_does_not_fit_the_model_is_named(fp_checkpoint, tmp_path):
    out = tmp_path / "q.npz"
    pipeline.quantize_checkpoint(
        fp_checkpoint, out, _recipe("int8"), backend=embedded.EmbeddedClient()
    )
    model, _ = _linen()
    ptq_model = qwix.quantize_model(model, qwix.PtqProvider(_rules("int4")))
    abstract = jax.eval_shape(ptq_model.init, jax.random.key(0), MODEL_INPUT)["params"]
    with pytest.raises(ValueError, match=r"Dense_0/kernel/array/qvalue: the model wants int4"):
        checkpoints.load(out, like={"linen": abstract})
    with pytest.raises(ValueError, match=r"lacks \['linen'\]"):
        loader.fill({"linen": abstract}, {})


# ------------------------------------------------------------------------------------ SRQ

SRQ_RULES = [pb.ModelRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]
MLP_CONFIG = {"in_features": 16, "hidden": [64], "out_features": 16}


@pytest.fixture(scope="module")
def srq(server, tmp_path_factory):
    """PTQ params from a remote Calibrate of the zoo MLP, and the model and data behind them."""
    config = zoo.config_from_json(zoo.BUILTIN["mlp"], json.dumps(MLP_CONFIG))
    model = zoo.BUILTIN["mlp"].build(config)
    x = np.asarray(random_inputs.normal(jax.random.key(2), (32, 16)), np.float32)
    params = model.init(jax.random.key(3), x[:1])["params"]
    with Client(server.address) as client:
        upload = client.upload(safetensors.numpy.save(_flat(params)))
        start = pb.CalibrateStart(
            model=pb.ModelSpec(name="mlp", config_json=json.dumps(MLP_CONFIG)),
            params_upload_id=upload.upload_id,
            rules=SRQ_RULES,
            return_ptq_params=True,
        )
        result = client.calibrate(start, np.split(x, 4))
    return model, params, x, result


@pytest.mark.parametrize("fmt", sorted(SUFFIX))
def test_remote_srq_params_load_into_the_ptq_model(srq, tmp_path, fmt):
    model, params, x, result = srq
    out = tmp_path / f"ptq{SUFFIX[fmt]}"
    client_calibrate.write_ptq(result, str(out))
    rules = [
        qwix.QuantizationRule(
            module_path=".*", weight_qtype="int8", act_qtype="int8", act_static_scale=True
        )
    ]
    ptq_model = qwix.quantize_model(model, qwix.PtqProvider(rules))
    abstract = jax.eval_shape(ptq_model.init, jax.random.key(0), x[:1])["params"]
    # The in-process reference: quantize_params with the calibrated statistics.
    stats = loader.nest({k: v for k, v in result.stats.items() if not k.startswith("final_output")})
    expected_params = qwix.quantize_params(params, abstract, stats)
    # Activation scales in the layout of every PTQ param: P/array (the NNX pure dict's form).
    plain = checkpoints.load(out)
    assert set(plain["Dense_0"]["dot_general0_lhs_scale"]) == {"array"}
    loaded = checkpoints.load(out, like=abstract)
    scale = loaded["Dense_0"]["dot_general0_lhs_scale"]
    assert isinstance(scale, qwix.WithAux) and scale.array.dtype == np.float32
    _assert_same_params(jax.tree.map(np.asarray, loaded), jax.tree.map(np.asarray, expected_params))
    expected = ptq_model.apply({"params": expected_params}, x)
    got = ptq_model.apply({"params": loaded}, x)
    assert np.asarray(got).tobytes() == np.asarray(expected).tobytes()


def test_fill_keeps_flax_boxes_and_dataclass_fields_that_are_not_arrays():
    abstract = jax.ShapeDtypeStruct((2, 3), np.float32)
    like = {"w": nn.Partitioned(abstract, names=("in", "out")), "b": abstract}
    value = np.ones((2, 3), np.float32)
    filled = loader.fill(like, {"w": value, "b": value, "extra": value})
    assert isinstance(filled["w"], nn.Partitioned) and filled["w"].names == ("in", "out")
    assert filled["w"].value is value and filled["b"] is value and filled["extra"] is value
    with pytest.raises(ValueError, match=r"w: the model wants float32\[2, 3\]"):
        loader.fill(like, {"w": np.ones(3, np.float32), "b": value})
