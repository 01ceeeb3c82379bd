"""AWQ and SmoothQuant through the CLI as a user runs them, on a model no registry knows:
`qmill export-program --method awq|smoothquant` -> `qmill calibrate` (against a server and
in-process) -> `qmill quantize --calibration`. The remote and in-process checkpoints are the same
bytes; loaded with `qmill.checkpoints.load`, they are exactly the params `awq.quantize_params` /
`smooth_quant.quantize_params` give in-process (the per-channel scale at P/awq_scale or
P/inv_sq_scale, beside P/array), and the reference's inference provider gives the same logits."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import numpy as np
import pytest

# A Linen MLP whose Dense kernels (256 -> 128 -> 16) have input features divisible by 128, so
# the rules' tile_size 128 and the int4 recipe's tile 128 make the same groups.
MODEL = """
import numpy as np
from flax import linen as nn


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16)(nn.relu(nn.Dense(128)(x)))


def build():
    return {"model": Mlp(), "inputs": (np.zeros((1, 256), np.float32),)}
"""
SQ_RULES = 'rules = [{weight_qtype = "int8", act_qtype = "int8"}]\n'
# method: (--rules, quantize --recipe, the in-process rule's fields, its per-channel part)
METHODS = {
    "awq": ("w4-g128", "int4", {"weight_qtype": "int4", "tile_size": 128}, "awq_scale"),
    "smoothquant": (
        "sq.toml",
        "int8",
        {"weight_qtype": "int8", "act_qtype": "int8"},
        "inv_sq_scale",
    ),
}


def _model(tmp: pathlib.Path):
    """The model file, its module, its float params (params.npz, 'params/'-prefixed) and a
    calibration set with a few salient input channels (AWQ's and SmoothQuant's setting)."""
    import jax

    from qmill.engine.programs import program as programs

    (tmp / "mlp.py").write_text(MODEL)
    (tmp / "sq.toml").write_text(SQ_RULES)
    spec = importlib.util.spec_from_file_location("awq_sq_mlp", tmp / "mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    params = module.Mlp().init(jax.random.key(0), np.zeros((1, 256), np.float32))["params"]
    flat = programs.flat_paths(jax.tree.map(np.asarray, params))
    np.savez(tmp / "params.npz", **{f"params/{k}": v for k, v in flat.items()})
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(64, 256)) * np.where(np.arange(256) % 16 == 0, 20.0, 1.0)).astype(
        np.float32
    )
    np.save(tmp / "cal.npy", x)
    return module, params, x


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
def test_remote_and_in_process_give_the_reference_params(tmp_path, make_server, run_qmill, method):
    module, params, x = _model(tmp_path)
    outputs, stats_file = _calibrated_outputs(tmp_path, make_server, run_qmill, method)
    assert outputs["remote"].read_bytes() == outputs["local"].read_bytes()
    _check_against_the_reference(method, module, params, x, stats_file, outputs["local"])
    _check_compressed_tensors_refuses(tmp_path, run_qmill, method, stats_file)


def _calibrated_outputs(tmp_path, make_server, run_qmill, method):
    """The program, its calibration on a server and in-process, and the checkpoint quantized
    with each ({"remote", "local"}: path); and the in-process statistics file."""
    rules_arg, recipe, _, _ = METHODS[method]
    rules_arg = str(tmp_path / rules_arg) if rules_arg.endswith(".toml") else rules_arg
    made = run_qmill(
        "export-program", "--model-fn", f"{tmp_path / 'mlp.py'}:build",
        "--params", str(tmp_path / "params.npz"), "--method", method, "--rules", rules_arg,
        "--batch-size", "32", "-o", str(tmp_path / "prog.qprog"),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    address = make_server(data_dir=str(tmp_path / "data")).address
    common = ["--artifact", str(tmp_path / "prog.qprog"), "--params", str(tmp_path / "params.npz")]
    common += ["--batches", str(tmp_path / "cal.npy")]
    remote = run_qmill("calibrate", "--server", address, *common)
    assert remote.returncode == 0, remote.stderr
    calibration_id = re.search(r"calibration (\S+):", remote.stdout)[1]
    stats_file = tmp_path / "stats.npz"
    local = run_qmill("calibrate", *common, "--stats-output", str(stats_file))
    assert local.returncode == 0, local.stderr
    outputs = {}
    for name, calibration in (
        ("remote", ["--server", address, "--calibration", calibration_id]),
        ("local", ["--calibration", str(stats_file)]),
    ):
        out = tmp_path / f"{name}.safetensors"
        done = run_qmill(
            "quantize", str(tmp_path / "params.npz"), "--recipe", recipe, "-o", str(out),
            *calibration,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        outputs[name] = out
    return outputs, stats_file


def _check_against_the_reference(method, module, params, x, stats_file, output):
    """In-process, the reference's way (the PTQ abstract params, the same statistics): the
    checkpoint `output` holds exactly its params, which give exactly its logits."""
    import jax

    import qmill.engine as qe
    from qmill import checkpoints
    from qmill.checkpoints.loading import loader
    from qmill.engine.contrib import awq
    from qmill.engine.contrib import smooth_quant as sq

    _, _, rule_fields, beside = METHODS[method]
    rule, provider, lib = {
        "awq": (awq.AwqRule, awq.AwqInferenceProvider, awq),
        "smoothquant": (sq.SqRule, sq.SqInferenceProvider, sq),
    }[method]
    rules = [rule(module_path=".*", **rule_fields)]
    model = module.Mlp()
    abstract = jax.eval_shape(
        qe.quantize_model(model, qe.PtqProvider(rules)).init, jax.random.key(0), x
    )
    with np.load(stats_file) as f:
        stats = loader.nest({k: f[k] for k in f.files})
    expected = lib.quantize_params(params, abstract["params"], stats)
    # The checkpoint read back into the reference's param tree: `like=` the abstract of what
    # quantize_params returns gives its WithAwqScale / WithSqScale leaves.
    like = jax.eval_shape(lambda: lib.quantize_params(params, abstract["params"], stats))
    # as_jax: with numpy leaves the eager dequantization runs partly in numpy, an ulp off XLA's
    # in the logits (measured 2e-6; the same for the in-process params sent through numpy).
    loaded = checkpoints.load(output, like={"params": like}, as_jax=True)["params"]
    assert set(checkpoints.load(output)["params"]["Dense_0"]["kernel"]) == {"array", beside}
    leaves = jax.tree_util.tree_leaves_with_path(expected)
    assert jax.tree.structure(loaded) == jax.tree.structure(expected)
    for (path, want), got in zip(leaves, jax.tree_util.tree_leaves(loaded), strict=True):
        assert np.asarray(got).dtype == np.asarray(want).dtype, path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(path))
    for layer in ("Dense_0", "Dense_1"):
        assert getattr(loaded[layer]["kernel"], beside).shape == (params[layer]["kernel"].shape[0],)
    served = qe.quantize_model(model, provider(rules))
    # The same params in the same program: the same logits, bit for bit (no tolerance needed).
    np.testing.assert_array_equal(
        np.asarray(served.apply({"params": loaded}, x)),
        np.asarray(served.apply({"params": expected}, x)),
    )
    if method == "awq":  # and it did its job: closer to the float model than RTN's
        ref = np.asarray(model.apply({"params": params}, x))
        ptq = qe.quantize_model(model, qe.PtqProvider(rules))
        rtn = ptq.apply({"params": qe.quantize_params(params, abstract["params"])}, x)
        err = np.mean(np.abs(np.asarray(served.apply({"params": loaded}, x)) - ref))
        assert err < np.mean(np.abs(np.asarray(rtn) - ref)), err


def _check_compressed_tensors_refuses(tmp_path, run_qmill, method, stats_file):
    """compressed-tensors cannot hold the per-channel scale: refused before any work, whether
    the format is asked for or implied by a scheme's name."""
    out = tmp_path / "ct"
    ct = (
        ["--recipe", "W4A16"]
        if method == "awq"
        else ["--recipe", "W8A8", "--format", "compressed-tensors"]
    )
    refused = run_qmill(
        "quantize", str(tmp_path / "params.npz"), *ct, "-o", str(out),
        "--calibration", str(stats_file),
    )  # fmt: skip
    assert refused.returncode == 1
    assert f"{method} params carry a per-input-channel scale" in refused.stderr
    assert "llm-compressor folds AWQ scales into the previous layer" in refused.stderr
    assert not out.exists() and not list(tmp_path.glob("ct*"))
