"""compressed-tensors in: folders llm-compressor writes load through qmill.checkpoints.load as
the Qwix PTQ tree (the weights compressed-tensors decompresses to), and `qmill inspect` and the
CLI handle them."""

from __future__ import annotations

import subprocess

import ml_dtypes
import numpy as np
import pytest

from qmill import checkpoints
from tests.e2e import processes
from tests.interop.conftest import LLAMA_IGNORE, assert_same_checkpoint

SCHEMES = [
    "W4A16",
    "W4A16_ASYM",
    "W8A16",
    "W8A8",
    "FP8_DYNAMIC",
    "FP8_BLOCK",
    "MXFP4A16",
    "NVFP4A16",
    # One of each layout the newer presets add (odd bits packed, sub-8-bit codes one per int8,
    # MX fp8).
    "W3A16",
    "W4A8",
    "MXFP8",
]


def _dequantize(parts: dict[str, np.ndarray]) -> np.ndarray:
    """(qvalue - zero_point) * scale, each scale (and zero point) spread over its tile, rounded
    once to the scale's dtype as compressed-tensors' decompression rounds."""
    q = np.asarray(parts["qvalue"]).astype(np.float32)
    scale = np.asarray(parts["scale"])

    def spread(a: np.ndarray) -> np.ndarray:
        a = np.asarray(a).astype(np.float32)
        for axis in (0, 1):
            a = np.repeat(a, q.shape[axis] // a.shape[axis], axis=axis)
        return a

    if "zero_point" in parts:
        q = q - spread(parts["zero_point"])
    return (q * spread(scale)).astype(scale.dtype)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_llm_compressor_folder_loads_as_compressed_tensors_decompresses_it(llama, peer, scheme):
    import torch
    from compressed_tensors.compressors import decompress_module
    from transformers import AutoModelForCausalLM

    folder = peer(llama, scheme, LLAMA_IGNORE)
    tree = checkpoints.load(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    for module in model.modules():  # compressed-tensors' own decompression, module by module
        decompress_module(module)
    decompressed = model.state_dict()
    quantized = [k for k, v in tree.items() if isinstance(v, dict)]
    assert len(quantized) == 14
    for name in quantized:
        theirs = decompressed[name].view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        # Rounded once to the model's dtype (NVFP4's float32 scale, scale / global scale).
        ours = _dequantize(tree[name]["array"]).astype(theirs.dtype)
        np.testing.assert_array_equal(ours, theirs, err_msg=name)
    # Float tensors come as stored, and the Flax layout is the same leaves transposed.
    assert tree["lm_head.weight"].dtype == ml_dtypes.bfloat16
    flax = checkpoints.load(folder, flax_layout=True)
    for part, value in tree[quantized[0]]["array"].items():
        np.testing.assert_array_equal(flax[quantized[0]]["array"][part], value.T)


def test_flax_layout_is_refused_for_other_checkpoints(tmp_path):
    np.savez(tmp_path / "x.npz", w=np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match="not a compressed-tensors checkpoint"):
        checkpoints.load(tmp_path / "x.npz", flax_layout=True)


@pytest.mark.slow  # starts `qmill` processes
def test_cli_writes_and_inspects_compressed_tensors(tmp_path, llama, peer):
    out = tmp_path / "out"
    command = [*processes.qmill(), "quantize", str(llama), "-o", str(out), "--recipe", "w4a16"]
    done = subprocess.run([*command, "-q"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    reference = peer(llama, "W4A16", LLAMA_IGNORE)
    assert_same_checkpoint(out, reference)
    for folder in (out, reference):
        shown = subprocess.run(
            [*processes.qmill(), "inspect", str(folder)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert shown.returncode == 0, shown.stderr
        assert "quantized (compressed-tensors)" in shown.stdout
        assert "scheme W4A16, format pack-quantized" in shown.stdout
        assert "14 compressed-tensors weights" in shown.stdout
    # A recipe that is no scheme's, for this format: one line saying what to pass instead.
    bad = subprocess.run(
        [*command, "--recipe", "nf4", "--format", "compressed-tensors", "-o", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 1 and "W4A16" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow  # starts `qmill` processes
def test_cli_killed_mid_run_resumes_to_the_same_bytes(tmp_path, llama):
    once, out = tmp_path / "once", tmp_path / "resumed"
    args = ["quantize", str(llama), "--recipe", "W4A16_ASYM", "-q"]
    done = subprocess.run([*processes.qmill(), *args, "-o", str(once)], capture_output=True)
    assert done.returncode == 0, done.stderr
    slow = subprocess.Popen(
        [*processes.qmill(read_delay=0.5), *args, "-o", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    processes.wait_for_finished_tensors(out, 3, slow)
    processes.kill(slow)  # SIGKILL: no cleanup, the partial output stays
    assert not out.exists()
    done = subprocess.run([*processes.qmill(), *args, "-o", str(out)], capture_output=True)
    assert done.returncode == 0, done.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {
        p.name: p.read_bytes() for p in once.iterdir()
    }
