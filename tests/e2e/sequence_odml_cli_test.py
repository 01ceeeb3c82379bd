"""A sequence model (activations (batch, sequence, features)) from calibration to LiteRT through
the CLI: `w8a8-static` keeps one activation scale per token, which `export-odml` refuses with the
fix in the message; `w8a8-static-seq` averages the statistics over batch and sequence (one scale
per tensor) and the model exports."""

from __future__ import annotations

import textwrap

import jax
import numpy as np

from qmill.engine.programs import program as programs

MODEL = textwrap.dedent(
    """
    import flax.linen as nn
    import numpy as np


    class Seq(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(nn.relu(nn.Dense(32)(x)))


    def build() -> dict:
        return {"model": Seq(), "inputs": (np.zeros((1, 6, 16), np.float32),)}
    """
)


def _setup(tmp):
    (tmp / "seqmodel.py").write_text(MODEL)
    namespace: dict = {}
    exec(MODEL, namespace)
    params = namespace["Seq"]().init(jax.random.key(0), np.zeros((1, 6, 16), np.float32))
    flat = programs.flat_paths(jax.tree.map(np.asarray, params["params"]))
    np.savez(tmp / "seq.npz", **{f"params/{k}": v for k, v in flat.items()})
    np.save(tmp / "cal.npy", np.random.default_rng(0).normal(size=(64, 6, 16)).astype(np.float32))


def _calibrate(tmp, run_qmill, rules: str) -> np.lib.npyio.NpzFile:
    made = run_qmill(
        "export-program", "--model-fn", f"{tmp / 'seqmodel.py'}:build", "--params",
        str(tmp / "seq.npz"), "--batch-size", "32", "--rules", rules,
        "-o", str(tmp / f"{rules}.qprog"),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    cal = run_qmill(
        "calibrate", "--artifact", str(tmp / f"{rules}.qprog"), "--params", str(tmp / "seq.npz"),
        "--batches", str(tmp / "cal.npy"), "--stats-output", str(tmp / f"{rules}.npz"),
    )  # fmt: skip
    assert cal.returncode == 0, cal.stderr
    return np.load(tmp / f"{rules}.npz")


def _export(tmp, run_qmill, address: str, rules: str):
    return run_qmill(
        "export-odml", "--server", address, "--model-fn", f"{tmp / 'seqmodel.py'}:build",
        "--params", str(tmp / "seq.npz"), "--stats", str(tmp / f"{rules}.npz"), "--rules", "w8a8",
        "-o", str(tmp / f"{rules}.tflite"),
    )  # fmt: skip


def test_sequence_preset_gives_statistics_litert_stores(tmp_path, make_server, run_qmill):
    _setup(tmp_path)
    address = make_server(data_dir=str(tmp_path / "data")).address
    per_token = _calibrate(tmp_path, run_qmill, "w8a8-static")
    assert per_token["Dense_0/dot_general0_lhs/sum_of_absmax"].shape == (1, 6, 1)
    refused = _export(tmp_path, run_qmill, address, "w8a8-static")
    assert refused.returncode != 0
    assert "6 activation scales" in refused.stderr and "w8a8-static-seq" in refused.stderr
    assert "Traceback" not in refused.stderr

    per_tensor = _calibrate(tmp_path, run_qmill, "w8a8-static-seq")
    assert per_tensor["Dense_0/dot_general0_lhs/sum_of_absmax"].shape == (1, 1, 1)
    # act_batch_axes are averaged over (as the reference's): the tensor's statistic is an
    # average over the tokens too, so it lies within the per-token statistics' range.
    whole = per_tensor["Dense_0/dot_general0_lhs/sum_of_absmax"].item()
    tokens = per_token["Dense_0/dot_general0_lhs/sum_of_absmax"]
    assert tokens.min() < whole < tokens.max()
    exported = _export(tmp_path, run_qmill, address, "w8a8-static-seq")
    assert exported.returncode == 0, exported.stderr
    assert "weights: INT8 2" in exported.stdout
    assert (tmp_path / "w8a8-static-seq.tflite").stat().st_size > 0
