"""Issue 37: a checkpoint quantized on the GPU is the CPU's, byte for byte, for every preset.

    python bench/gpu/preset_parity.py --json OUT.json          # on a machine with a GPU

Writes a small Hugging Face folder (Llama tensor names, bf16 and float32 weights of several
shapes, random values with a fixed seed), then quantizes it with every qmill preset and every
compressed-tensors scheme twice, in two processes: one with JAX's default device (the GPU) and
one with JAX_PLATFORMS=cpu, each running `qmill quantize` in process for every recipe (the
engine the server runs). Every output file is compared byte for byte; the JSON lists, per
recipe, whether the outputs are equal and which files differ. Exit status 1 if any differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

RECIPES = (
    "int8", "int4", "fp8", "nf4",
    "W4A16", "W4A16_ASYM", "W8A16", "W8A8", "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16", "MXFP4A16",
)  # fmt: skip


def make_folder(folder: pathlib.Path) -> None:
    import ml_dtypes
    import numpy as np
    import safetensors.numpy

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256}
    (folder / "config.json").write_text(json.dumps(config))
    tensors = {}
    for i, dtype in enumerate((ml_dtypes.bfloat16, np.float32)):
        p = f"model.layers.{i}."
        for name, shape in (
            ("self_attn.q_proj.weight", (256, 256)),
            ("mlp.up_proj.weight", (512, 256)),
            ("mlp.down_proj.weight", (256, 512)),
        ):
            scale = rng.uniform(0.01, 2.0)
            tensors[p + name] = (rng.standard_normal(shape) * scale).astype(dtype)
        tensors[p + "input_layernorm.weight"] = np.ones(256, dtype)
    safetensors.numpy.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def quantize_all(source: str, out: str) -> None:
    """In this process: every recipe through the CLI's own entry point."""
    from qmill.cli import main as cli

    for recipe in RECIPES:
        rc = cli.main(["quantize", source, "-o", f"{out}/{recipe}", "--recipe", recipe, "-q"])
        if rc != 0:
            raise SystemExit(f"{recipe}: exit {rc}")


def digests(root: pathlib.Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "run":
        quantize_all(sys.argv[2], sys.argv[3])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="qmill-preset-parity-"))
    make_folder(work / "source")
    outputs = {}
    for platform in ("default", "cpu"):
        env = dict(os.environ)
        if platform == "cpu":
            env["JAX_PLATFORMS"] = "cpu"
        out = work / platform
        out.mkdir()
        command = [sys.executable, __file__, "run", str(work / "source"), str(out)]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 2
        outputs[platform] = out
    result = {}
    for recipe in RECIPES:
        gpu, cpu = digests(outputs["default"] / recipe), digests(outputs["cpu"] / recipe)
        differ = sorted(n for n in gpu.keys() | cpu.keys() if gpu.get(n) != cpu.get(n))
        result[recipe] = {"equal": not differ, "files": len(gpu), "differ": differ}
        print(recipe, "equal" if not differ else f"DIFFER: {differ}", flush=True)
    pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if all(r["equal"] for r in result.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
