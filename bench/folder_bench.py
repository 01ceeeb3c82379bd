"""Whole commands on a Hugging Face folder: `qmill quantize` (embedded) against `cp -r`.

    python bench/folder_bench.py [--gib 1.0] [--recipe int4] [--format F] [--repeat 3]
                                 [--json bench/results/folder.json] [--workdir DIR]

A Llama-architecture folder (config.json + model.safetensors, bfloat16, TinyLlama's shapes:
hidden 2048, intermediate 5632, 4 KV heads, vocabulary 32000, as many decoder layers as reach
`--gib`) is generated offline from a seeded normal distribution. Then, interleaved `--repeat`
times (the machine may be shared and its load moves): `cp -r` of the folder, and the whole
`qmill quantize FOLDER -o OUT --recipe R -q` command in its own process (interpreter start and
imports included), in-process engine, no server. Reported: each run's seconds, the best, the
ratio qmill / cp of the best runs, qmill's peak RSS (its own VmHWM, read as it exits) against
the target 3 × largest tensor + 300 MB, and its CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import e2e_bench
import ml_dtypes
import numpy as np

from qmill.checkpoints.formats.safetensors import header as safetensors_header

HIDDEN, INTERMEDIATE, KV_HEADS, HEADS, VOCAB = 2048, 5632, 4, 32, 32000


def _layer_shapes(i: int) -> dict[str, list[int]]:
    kv = HIDDEN // HEADS * KV_HEADS
    p = f"model.layers.{i}."
    return {
        p + "input_layernorm.weight": [HIDDEN],
        p + "self_attn.q_proj.weight": [HIDDEN, HIDDEN],
        p + "self_attn.k_proj.weight": [kv, HIDDEN],
        p + "self_attn.v_proj.weight": [kv, HIDDEN],
        p + "self_attn.o_proj.weight": [HIDDEN, HIDDEN],
        p + "post_attention_layernorm.weight": [HIDDEN],
        p + "mlp.gate_proj.weight": [INTERMEDIATE, HIDDEN],
        p + "mlp.up_proj.weight": [INTERMEDIATE, HIDDEN],
        p + "mlp.down_proj.weight": [HIDDEN, INTERMEDIATE],
    }


def make_llama_folder(folder: pathlib.Path, gib: float, *, seed: int = 0) -> tuple[int, int]:
    """Writes the folder; returns (bytes of weights, bytes of the largest tensor)."""
    fixed = {"model.embed_tokens.weight": [VOCAB, HIDDEN], "lm_head.weight": [VOCAB, HIDDEN]}
    per_layer = sum(int(np.prod(s)) * 2 for s in _layer_shapes(0).values())
    fixed_bytes = sum(int(np.prod(s)) * 2 for s in fixed.values())
    layers = max(1, round((gib * 2**30 - fixed_bytes) / per_layer))
    shapes = {"model.embed_tokens.weight": fixed["model.embed_tokens.weight"]}
    for i in range(layers):
        shapes |= _layer_shapes(i)
    shapes |= {"model.norm.weight": [HIDDEN], "lm_head.weight": fixed["lm_head.weight"]}
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    folder.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": layers,
        "vocab_size": VOCAB,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    rng = np.random.default_rng(seed)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(safetensors_header.encode_header(header, {"format": "pt"}))
        for shape in shapes.values():
            values = rng.standard_normal(shape, np.float32) * 0.02
            f.write(values.astype(ml_dtypes.bfloat16).tobytes())
    largest = max(int(np.prod(s)) * 2 for s in shapes.values())
    return offset, largest


def _drop(path: pathlib.Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def copy_once(src: pathlib.Path, dst: pathlib.Path) -> float:
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    seconds = time.perf_counter() - start
    _drop(dst)
    return seconds


def quantize_once(
    src: pathlib.Path, dst: pathlib.Path, recipe: str, fmt: str | None
) -> tuple[float, float, float]:
    """(seconds, peak RSS MB, CPU seconds) of one whole `qmill quantize` command, embedded."""
    hwm = dst.with_name("hwm")
    args = ["quantize", str(src), "-o", str(dst), "--recipe", recipe, "-q"]
    args += ["--format", fmt] if fmt else []
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", e2e_bench.CLIENT, *args],
        env={**os.environ, "QMILL_BENCH_HWM": str(hwm)},
    )
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"qmill quantize failed with status {status}")
    peak_mb = int(hwm.read_text()) / 1024
    hwm.unlink()
    _drop(dst)
    return seconds, peak_mb, usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--recipe", default="int4")
    parser.add_argument("--format", default=None, help="qmill quantize --format (default: same)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="qmill-folder-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "llama"
    try:
        if not (src / "model.safetensors").exists():
            _drop(src)
            make_llama_folder(src, args.gib)
        nbytes = (src / "model.safetensors").stat().st_size
        header = safetensors_header.read_header(src / "model.safetensors")[0]
        largest = max(e["data_offsets"][1] - e["data_offsets"][0] for e in header.values())
        copies, runs = [], []
        copy_once(src, work / "copy")  # warm the page cache
        for _ in range(args.repeat):
            copies.append(copy_once(src, work / "copy"))
            runs.append(quantize_once(src, work / "out", args.recipe, args.format))
            print(f"cp {copies[-1]:.2f} s, qmill {runs[-1]}", file=sys.stderr, flush=True)
    finally:
        if not args.workdir:
            _drop(work)
    best_cp, best_q = min(copies), min(r[0] for r in runs)
    result = {
        **e2e_bench.environment(),
        "folder_MB": round(nbytes / 1e6, 1),
        "largest_tensor_MB": round(largest / 1e6, 1),
        "recipe": args.recipe,
        "format": args.format or "same as source",
        "cp_seconds": [round(s, 2) for s in copies],
        "qmill_seconds": [round(r[0], 2) for r in runs],
        "qmill_peak_rss_MB": [round(r[1], 1) for r in runs],
        "qmill_cpu_s": [round(r[2], 2) for r in runs],
        "ratio_qmill_to_cp": round(best_q / best_cp, 2),
        "rss_target_MB": round(3 * largest / 1e6 + 300, 1),
    }
    e2e_bench.print_and_save(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
