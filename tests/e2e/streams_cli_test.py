"""`qmill quantize --streams N` as a user runs it: the same checkpoint as one stream."""

from __future__ import annotations

import numpy as np
import safetensors.numpy


def test_streams_flag_writes_the_one_stream_checkpoint(run_qmill, server, tmp_path):
    rng = np.random.default_rng(3)
    tensors = {f"layers.{i}.weight": rng.normal(size=(48, 64)).astype(np.float32) for i in range(8)}
    tensors["layers.0.bias"] = np.zeros(48, np.float32)
    src = tmp_path / "model.safetensors"
    safetensors.numpy.save_file(tensors, str(src))
    outputs = {}
    for streams in ("1", "3"):
        out = tmp_path / f"out{streams}.safetensors"
        done = run_qmill(
            "quantize", str(src), "-o", str(out), "--server", server.address, "--recipe", "int4",
            "--streams", streams, "-q",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        outputs[streams] = out.read_bytes()
    assert outputs["3"] == outputs["1"]


def test_streams_zero_is_a_user_error(run_qmill, server, tmp_path):
    src = tmp_path / "model.safetensors"
    safetensors.numpy.save_file({"w": np.ones((8, 8), np.float32)}, str(src))
    done = run_qmill(
        "quantize", str(src), "-o", str(tmp_path / "o.safetensors"), "--server", server.address,
        "--streams", "0",
    )  # fmt: skip
    assert done.returncode == 1
    assert "--streams must be >= 1, got 0" in done.stderr
    assert "Traceback" not in done.stderr
