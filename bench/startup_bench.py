"""How long `qmill` takes to start: whole commands, as a user runs them.

    python bench/startup_bench.py [--runs 7] [--json bench/results/startup.json]

Each command runs `--runs` times in a fresh process (the installed `qmill` console script of this
environment, cwd a scratch copy of examples/); the table gives the median and the fastest wall
time, and which of jax, grpc and orbax the command's process imported (`python -X importtime`
of the same command, so the answer is the process's own, not a guess). Columns: median and
fastest wall time, and the median CPU time (user + system): on a loaded machine the wall time
stretches, the CPU time much less, and start-up is one thread, so the CPU time is close to what
a quiet machine's wall clock shows.

XLA's compilation cache is wherever $QMILL_COMPILATION_CACHE says (set it to a scratch folder to
keep the bench out of ~/.cache/qmill/xla); the first of the runs fills it, the others load it.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEAVY = ("jax", "grpc", "orbax")
COMMANDS = {
    "--version": ["--version"],
    "--help": ["--help"],
    "quantize --help": ["quantize", "--help"],
    "inspect (quick-start model)": ["inspect", "examples/tiny-mlp"],
    "quick start (quantize, in-process)": [
        "quantize", "examples/tiny-mlp", "-o", "tiny-mlp-int8", "--recipe", "int8", "--overwrite",
    ],
    # Issue 27's path on a folder small enough that only start-up counts (made by _tiny_llama).
    "HF folder (W4A16, compressed-tensors)": [
        "quantize", "tiny-llama", "-o", "tiny-llama-w4a16", "--recipe", "W4A16",
        "--format", "compressed-tensors", "--overwrite", "-q",
    ],
}  # fmt: skip


def _tiny_llama(folder: pathlib.Path) -> None:
    """A Llama-layout Hugging Face folder of 4.3 MB (hidden 256, 2 layers, bf16): the tensor
    names and the three weight shapes of /tmp/llama-1g, so the same programs are compiled."""
    import ml_dtypes
    import numpy as np
    import safetensors.numpy

    hidden, inter, vocab = 256, 768, 1024
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden}
    config.update(intermediate_size=inter, num_hidden_layers=2, vocab_size=vocab)
    config.update(num_attention_heads=4, num_key_value_heads=4, torch_dtype="bfloat16")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden)}
    shapes["model.norm.weight"] = (hidden,)
    for layer in range(2):
        p = f"model.layers.{layer}."
        shapes.update({f"{p}self_attn.{n}_proj.weight": (hidden, hidden) for n in "qkvo"})
        shapes.update({f"{p}mlp.{n}_proj.weight": (inter, hidden) for n in ("gate", "up")})
        shapes[f"{p}mlp.down_proj.weight"] = (hidden, inter)
        shapes.update({f"{p}{n}_layernorm.weight": (hidden,) for n in ("input", "post_attention")})
    tensors = {k: (rng.normal(size=s) * 0.02).astype(ml_dtypes.bfloat16) for k, s in shapes.items()}
    safetensors.numpy.save_file(tensors, str(folder / "model.safetensors"), {"format": "pt"})


def _qmill() -> list[str]:
    exe = shutil.which("qmill", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "qmill.cli"]


def _time(args: list[str], cwd: pathlib.Path, runs: int) -> tuple[list[float], list[float]]:
    """Wall and CPU (user + system) seconds of each run."""
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run([*_qmill(), *args], cwd=cwd, check=True, capture_output=True)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return walls, cpus


def _imported(args: list[str], cwd: pathlib.Path) -> list[str]:
    """Which of HEAVY the command's process imported (its -X importtime lines)."""
    code = "import sys; from qmill.cli import main; sys.exit(main.main())"
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    )
    names = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()}
    return [h for h in HEAVY if h in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        cwd = pathlib.Path(scratch)
        shutil.copytree(ROOT / "examples", cwd / "examples")
        _tiny_llama(cwd / "tiny-llama")
        for name, command in COMMANDS.items():
            walls, cpus = _time(command, cwd, args.runs)
            imported = _imported(command, cwd)
            row = {
                "command": name,
                "median_s": round(statistics.median(walls), 3),
                "min_s": round(min(walls), 3),
                "cpu_median_s": round(statistics.median(cpus), 3),
                "imports": imported,
            }
            results.append(row)
            print(
                f"| {name} | {row['median_s']:.2f} | {row['min_s']:.2f} | "
                f"{row['cpu_median_s']:.2f} | {', '.join(imported) or '-'} |",
                flush=True,
            )
    machine = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    print(machine)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"machine": machine, "results": results}))


if __name__ == "__main__":
    main()
