"""GPTQ through the CLI as a user runs it, on a model no registry knows (examples/digits_cnn.py):
`qmill export-program --method gptq` -> `qmill calibrate` -> `qmill quantize --calibration`, once
against a server (calibration id) and once in-process (statistics file): the same checkpoint,
byte for byte, which differs from plain RTN exactly where GPTQ had statistics."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest
import safetensors.numpy

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "digits_cnn.py"


def _params(tmp: pathlib.Path) -> pathlib.Path:
    import importlib.util

    import jax

    spec = importlib.util.spec_from_file_location("digits_cnn_gptq", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    flat = {
        "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
        for path, v in jax.tree_util.tree_leaves_with_path(example.init_params())
    }
    np.savez(tmp / "cnn.npz", **{f"params/{k}": v for k, v in flat.items()})
    return tmp / "cnn.npz"


def _export_gptq(run_qmill, params: pathlib.Path, program: pathlib.Path) -> None:
    """The example's GPTQ calibration program (w4-g128, batches of 50), written to `program`."""
    made = run_qmill(
        "export-program", "--model-fn", f"{EXAMPLE}:build", "--params", str(params),
        "--method", "gptq", "--rules", "w4-g128", "--batch-size", "50", "-o", str(program),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr


@pytest.mark.slow
def test_gptq_remote_and_in_process_give_the_same_checkpoint(tmp_path, make_server, run_qmill):
    params = _params(tmp_path)
    x = np.random.default_rng(0).normal(size=(100, 8, 8, 1)).astype(np.float32)
    np.save(tmp_path / "cal.npy", x)
    _export_gptq(run_qmill, params, tmp_path / "gptq.qprog")
    address = make_server(data_dir=str(tmp_path / "data")).address
    common = ["--artifact", str(tmp_path / "gptq.qprog"), "--params", str(params), "--batches"]
    remote = run_qmill(
        "calibrate", "--server", address, *common, str(tmp_path / "cal.npy"),
        "--stats-output", str(tmp_path / "remote-stats.npz"),
    )  # fmt: skip
    assert remote.returncode == 0, remote.stderr
    calibration_id = re.search(r"calibration (\S+):", remote.stdout)[1]
    local = run_qmill(
        "calibrate", *common, str(tmp_path / "cal.npy"),
        "--stats-output", str(tmp_path / "local-stats.npz"),
    )  # fmt: skip
    assert local.returncode == 0, local.stderr
    assert "2 batches, 100 examples" in local.stdout
    with np.load(tmp_path / "remote-stats.npz") as a, np.load(tmp_path / "local-stats.npz") as b:
        assert set(a.files) == set(b.files) and "Dense_0/kernel_gptq/sum_of_hessian" in a.files
        for key in a.files:
            np.testing.assert_array_equal(a[key], b[key])
    outputs = {}
    for name, calibration in (
        ("remote", ["--server", address, "--calibration", calibration_id]),
        ("local", ["--calibration", str(tmp_path / "local-stats.npz")]),
        ("rtn", []),
    ):
        out = tmp_path / f"{name}.safetensors"
        done = run_qmill("quantize", str(params), "--recipe", "int4", "-o", str(out), *calibration)
        assert done.returncode == 0, done.stderr
        outputs[name] = out
    assert outputs["remote"].read_bytes() == outputs["local"].read_bytes()
    gptq = safetensors.numpy.load_file(str(outputs["local"]))
    rtn = safetensors.numpy.load_file(str(outputs["rtn"]))
    assert set(gptq) == set(rtn)
    differs = {k for k in gptq if not np.array_equal(gptq[k], rtn[k])}
    # Both Dense kernels had statistics (the conv none: GPTQ collects dot_general/einsum inputs).
    assert {k.split("/")[1] for k in differs} == {"Dense_0", "Dense_1"}, differs


@pytest.mark.slow
def test_statistics_over_the_server_limit_are_refused(tmp_path, make_server, run_qmill):
    params = _params(tmp_path)
    np.save(tmp_path / "cal.npy", np.zeros((50, 8, 8, 1), np.float32))
    _export_gptq(run_qmill, params, tmp_path / "gptq.qprog")
    address = make_server(max_calibration_stats_bytes=1 << 20).address  # the Hessians need 4 MiB
    done = run_qmill(
        "calibrate", "--server", address, "--artifact", str(tmp_path / "gptq.qprog"),
        "--params", str(params), "--batches", str(tmp_path / "cal.npy"),
    )  # fmt: skip
    assert done.returncode != 0
    assert "RESOURCE_EXHAUSTED" in done.stderr and "max-calibration-stats-bytes" in done.stderr
