"""Issue 34/37: `qmill quantize FOLDER --method gptq` on a GPU against the CPU, same folder and
tokens, as whole commands.

    python bench/gpu/lm_gptq.py --json OUT.json [--layers 30] [--cpu-layers 8] [--samples 64]
        [--modes in-process,server] [--platforms default,cpu] [--log servers.log]

The folder is SmolLM2-135M's shape (576 wide, 1536 MLP, 9 heads / 3 KV heads, 49,152 tokens,
tied head) with RANDOM bf16 weights (the real ones cannot travel to a lent machine), written
here; the tokens are random too. Timing is what this measures, not quality. The CPU run is
pinned to 2 cores (`taskset -c 0,1`, like the dev VM) and may cover fewer layers (its per-layer
seconds are what to compare). Per run: wall seconds, peak RSS of the command, seconds per layer
(from --report-json), whether the GPU's and the CPU's codes agree on the layers both ran, and
whether a `qmill serve` on each platform (the client streaming the folder and the ids to it)
writes the same bytes as the in-process command.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np
import safetensors.numpy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import e2e_bench  # the `qmill serve` helpers: one way to start, pin and measure a server

SHAPE = {"hidden": 576, "inner": 1536, "heads": 9, "kv": 3, "vocab": 49152}


def make_folder(folder: pathlib.Path, layers: int) -> None:
    rng = np.random.default_rng(0)
    d, f, v = SHAPE["hidden"], SHAPE["inner"], SHAPE["vocab"]
    kv = SHAPE["kv"] * d // SHAPE["heads"]
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d,
        "intermediate_size": f, "num_hidden_layers": layers,
        "num_attention_heads": SHAPE["heads"], "num_key_value_heads": SHAPE["kv"],
        "vocab_size": v, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    }  # fmt: skip
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
            p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        }  # fmt: skip
    tensors = {
        n: (
            np.ones(s, np.float32) if len(s) == 1 else rng.normal(0, 0.04, s).astype(np.float32)
        ).astype(ml_dtypes.bfloat16)
        for n, s in shapes.items()
    }
    safetensors.numpy.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def pinned(command: list[str], cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus, *command] if cpus else command


def run(folder, ids, out, platform: str, cpus: str | None, address: str | None = None) -> dict:
    """One whole `qmill quantize --method gptq` command: in process (pinned to `cpus`), or
    as a client of the server at `address` (which does the work)."""
    report = out.with_suffix(".json")
    command = [*e2e_bench.QMILL, "quantize", str(folder), "-o", str(out),
               "--recipe", "W4A16", "--group-size", "64", "--method", "gptq",
               "--calibration-ids", str(ids), "--report-json", str(report), "-q"]  # fmt: skip
    if address:
        command += ["--server", address]
    else:
        command = pinned(command, cpus)
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    done = subprocess.run(
        command, env=e2e_bench.server_env(platform), capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    mode = "server" if address else "in-process"
    result = {"platform": platform, "mode": mode, "cpus": cpus, "rc": done.returncode,
              "wall_s": round(wall, 2)}  # fmt: skip
    # ru_maxrss of all children so far: exact for the first run, an upper bound after.
    result["peak_rss_mb_at_most"] = round(max(peak, before) / 1024, 1)
    if done.returncode != 0:
        result["stderr"] = done.stderr[-2000:]
        return result
    layers = json.loads(report.read_text())["calibration"]["layers"]
    seconds = [entry["seconds"] for entry in layers]
    result["layers"] = len(seconds)
    result["first_layer_s"] = seconds[0]
    result["median_layer_s"] = float(np.median(seconds[1:] or seconds))
    return result


def agreement(outs: list[pathlib.Path]) -> dict:
    """How many of the shallower output's tensors the other output has equal, element for
    element (the first layers of both folders hold the same random weights)."""
    first, second = (safetensors.numpy.load_file(o / "model.safetensors") for o in outs)
    names = sorted(set(first) & set(second))
    equal = [n for n in names if np.array_equal(first[n], second[n])]
    codes = [n for n in names if n.endswith("weight_packed")]
    values = sum(first[n].size for n in codes)
    same = sum(int((first[n] == second[n]).sum()) for n in codes)
    return {"tensors_compared": len(names), "tensors_equal": len(equal),
            "packed_code_words_equal_fraction": round(same / max(values, 1), 6)}  # fmt: skip


def measure(args, tmp: pathlib.Path, ids: pathlib.Path, platform: str, mode: str) -> dict:
    layers = args.layers if platform != "cpu" else args.cpu_layers
    folder = tmp / f"model-{layers}"
    if not folder.exists():
        make_folder(folder, layers)
    cpus = args.cpus if platform == "cpu" and args.cpus else None
    out = tmp / f"out-{platform}-{mode}-{layers}"
    if mode == "in-process":
        return run(folder, ids, out, platform, cpus) | {"model_layers": layers}
    # A data directory of its own: a server keeps calibrations by fingerprint, and a second
    # run of this bench would otherwise time the kept one.
    fresh = ("--data-dir", str(tmp / f"server-{platform}"))
    with e2e_bench.qmill_servers(1, platform, args.log, cpus, fresh) as [(pid, address)]:
        result = run(folder, ids, out, platform, cpus, address)
        result["server_peak_rss_mb"] = round(e2e_bench.peak_rss_mb(pid), 1)
    return result | {"model_layers": layers}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--cpu-layers", type=int, default=8)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--cpus", default="0,1", help="taskset list for the CPU run ('' = all)")
    parser.add_argument("--platforms", default="default,cpu")
    parser.add_argument("--modes", default="in-process,server", help="in-process and/or server")
    parser.add_argument("--log", default=None, help="the servers' output (appended)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="qmill-lm-gptq-"))
    results = []
    try:
        rng = np.random.default_rng(1)
        ids = tmp / "ids.npy"
        np.save(ids, rng.integers(0, SHAPE["vocab"], (args.samples, args.seq_len), np.int32))
        for mode in args.modes.split(","):
            for platform in args.platforms.split(","):
                results.append(measure(args, tmp, ids, platform, mode))
                print(json.dumps(results[-1]), flush=True)
                pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
        for mode in args.modes.split(","):
            outs = [tmp / f"out-{p}-{mode}-{args.layers if p != 'cpu' else args.cpu_layers}"
                    for p in args.platforms.split(",")]  # fmt: skip
            if len(outs) == 2 and all((o / "model.safetensors").exists() for o in outs):
                results.append({"mode": mode, "gpu_vs_cpu": agreement(outs)})
        first = args.platforms.split(",")[0]
        depth = args.layers if first != "cpu" else args.cpu_layers
        ins = [tmp / f"out-{first}-{m}-{depth}" for m in ("in-process", "server")]
        if all((o / "model.safetensors").exists() for o in ins):
            same = [(o / "model.safetensors").read_bytes() for o in ins]
            results.append({"server_same_bytes_as_in_process": len(set(same)) == 1})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        pathlib.Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r.get("rc", 0) == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
