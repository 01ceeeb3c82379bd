"""GPTQ W4A16 on small mixtures of experts (Mixtral, Qwen3-MoE; random weights), qmill against
llm-compressor, as whole commands (issue 36: "every expert's scales finite, logits of the
quantized model close to the peer-quantized model's").

    python bench/lm_moe_peer_bench.py [--models mixtral,qwen3_moe] [--tools ...] [--samples 16]
        [--seq-len 64] [--eval-samples 8] [--group-size 32] [--peer-dtype bfloat16]
        [--causal-check default,basic] [--work /tmp/lm-moe-peer] [--json ...]

Each model is a bf16 folder that transformers writes from seeded random weights (tests/
lm_folder.py's MIXTRAL / QWEN3_MOE fields, 4 layers, 8 experts, top 2; Qwen3-MoE's layer 0 a
dense MLP). Calibration and held-out ids are random below the vocabulary (fixed seed, disjoint
draws), the same .npy for every tool. Each run is one whole command, timed and its peak RSS
measured as bench/lm_gptq_bench.py does (its helpers):
  - peer:        llm-compressor's `oneshot`, GPTQModifier(W4A16, groups of --group-size,
                 targets Linear, ignore lm_head and the routers as its MoE examples do), its
                 defaults otherwise: the model loaded under load_quantizable_moe (its MoE docs;
                 where that fails, loaded plainly and linearized by oneshot, the failure kept),
                 moe_calibrate_all_experts=True (every token through every expert for the
                 statistics, the routed output passed on), the sequential pipeline;
  - peer-routed: the same with moe_calibrate_all_experts=False (each expert's routed tokens);
  - peer-basic:  the same with pipeline="basic" (one calibration pass of the whole float model,
                 then GPTQ: its attention gets its causal mask, see --causal-check);
  - qmill-all:   `qmill quantize --recipe W4A16 --group-size G --method gptq --calibration-ids
                 ids.npy --calibrate-all-experts` (what the peer does by default);
  - qmill:       the same without --calibrate-all-experts (routed tokens, qmill's default);
  - rtn:         `qmill quantize --recipe W4A16 --group-size G` (round to nearest; qmill's
                 compressed-tensors RTN equals model_free_ptq's, tests/interop/ct_write_test.py).
Each output is loaded with transformers in float32 (load(): kept bf16 tensors cast up; the
peer's Mixtral expert tensors renamed to the names transformers reads) and run on the held-out
ids: perplexity, and the logits' distances ||a - b|| (Frobenius, every held-out position) to
the source's and the peers'. Each output's safetensors are read for every expert's
weight_scale (finite and > 0) and the routers' dtype. --causal-check runs peer_causal for each
pipeline named. Results: bench/results/lm-moe-peer.json.

Needs the interop extra (torch, transformers, llmcompressor) and psutil.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import pathlib
import shutil
import subprocess
import sys

import lm_gptq_bench as gb  # bench/ is this script's directory: its timing and peer helpers
import lm_moe_read as rd

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS, EXPERTS, TOP_K = 4, 8, 2
TOOLS = ("peer", "peer-routed", "peer-basic", "qmill-all", "qmill", "rtn")
# The routers as llm-compressor's MoE examples ignore them (transformers 5's routers are not
# Linear modules, so targets="Linear" passes them by anyway; named for the record).
ROUTERS = ["re:.*block_sparse_moe.gate$", "re:.*mlp.gate$"]


def model_fields(name: str) -> tuple[str, dict]:
    """The config class and fields of the bench's `name` model."""
    from tests import lm_folder

    common = {"num_hidden_layers": LAYERS, "num_experts_per_tok": TOP_K}
    if name == "mixtral":
        return "MixtralConfig", dict(lm_folder.MIXTRAL, **common, num_local_experts=EXPERTS)
    if name == "qwen3_moe":
        return "Qwen3MoeConfig", dict(lm_folder.QWEN3_MOE, **common, num_experts=EXPERTS)
    raise ValueError(f"unknown model {name!r}: mixtral, qwen3_moe")


def _oneshot(model, ids, group_size: int, pipeline: str, **options) -> None:
    """llm-compressor's oneshot GPTQ W4A16 (groups of `group_size`, lm_head and the routers
    ignored) of `model` on the token ids, in its `pipeline` ("default": the one it infers,
    sequential for GPTQ), with any other oneshot `options`."""
    import numpy as np
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    dataset = Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist()}
    )
    # The ids are given: oneshot wants a processor all the same, never used on them (the
    # folders have no tokenizer).
    vocab = models.WordLevel(vocab={"[UNK]": 0}, unk_token="[UNK]")
    processor = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(vocab))
    scheme = gb._scheme("gptq", group_size)
    recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head", *ROUTERS])
    if pipeline != "default":
        options["pipeline"] = pipeline
    gb._cpu_without_pinning()
    oneshot(model=model, processor=processor, dataset=dataset, recipe=recipe,
            max_seq_length=ids.shape[1], num_calibration_samples=len(ids), **options)  # fmt: skip


def peer_gptq(source: str, output: str, ids: str, group_size: int, *how: str) -> None:
    """llm-compressor's GPTQ W4A16 on a mixture of experts (this runs in its own process).
    how = (all_experts "1" | "0", load, dtype, pipeline): load "quantizable": the model loaded
    under load_quantizable_moe, as its MoE docs ask; "plain": loaded by transformers, oneshot
    linearizing the experts after loading (its fallback)."""
    import numpy as np
    import torch
    from llmcompressor.modeling.moe.linearize import load_quantizable_moe
    from transformers import AutoModelForCausalLM

    all_experts, load, dtype, pipeline = how
    context = load_quantizable_moe() if load == "quantizable" else contextlib.nullcontext()
    with context:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype))
    _oneshot(model, np.load(ids), group_size, pipeline,
             moe_calibrate_all_experts=all_experts == "1", output_dir=output)  # fmt: skip


def peer_causal(source: str, ids_path: str, pipeline: str) -> None:
    """Whether the peer's calibration runs layer 0's attention causally: the input of layer 0's
    o_proj as its pipeline feeds it (a hook; two calibration windows, in order) against a plain
    transformers forward of the same windows, in float32. Token t of a causal attention sees
    tokens 0..t: the last token agrees either way, the first only if the mask was applied.
    Prints one JSON line (this runs in its own process)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    ids = np.load(ids_path)[:2]
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    seen: list = []
    o_proj = model.model.layers[0].self_attn.o_proj
    o_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    with torch.inference_mode():
        model(input_ids=torch.from_numpy(ids.astype(np.int64)))
    plain = seen.pop()
    _oneshot(model, ids, 32, pipeline, shuffle_calibration_samples=False)
    fed = torch.cat(seen[: len(ids)])  # the calibration pass (the sequential one propagates too)

    def rel(token: int) -> float:
        diff = (fed[:, token] - plain[:, token]).norm() / plain[:, token].norm()
        return round(float(diff), 6)

    print(json.dumps({"first_token_rel_diff": rel(0), "last_token_rel_diff": rel(-1)}))


def command(
    tool: str, source: pathlib.Path, out: pathlib.Path, ids: pathlib.Path, args, load="quantizable"
):
    """The whole command of one tool's run."""
    group = args.group_size
    if tool.startswith("peer"):
        every = "routed" not in tool
        pipeline = "basic" if tool == "peer-basic" else "default"
        return [sys.executable, __file__, "peer-gptq", str(source), str(out), str(ids),
                str(group), str(int(every)), load, args.peer_dtype, pipeline]  # fmt: skip
    qmill = [sys.executable, "-m", "qmill.cli", "quantize", str(source), "-o", str(out),
             "--recipe", "W4A16", "--group-size", str(group), "-q"]  # fmt: skip
    if tool == "rtn":
        return qmill
    gptq = ["--method", "gptq", "--calibration-ids", str(ids)]
    return [*qmill, *gptq, *(["--calibrate-all-experts"] if tool == "qmill-all" else [])]


def _failure(log: pathlib.Path) -> str:
    """A failed command's exception: the log's last lines from its last traceback on."""
    text = log.read_text()
    start = text.rfind("Traceback (most recent call last)")
    lines = text[start:].splitlines() if start >= 0 else text.splitlines()
    # /usr/bin/time's lines close every log: the exception is just above them.
    lines = [x.strip() for x in lines if x.strip() and not x.startswith(("Command ", "maxrss_kb"))]
    return " | ".join(lines[-3:])


def run_tool(tool: str, source: pathlib.Path, work: pathlib.Path, args) -> dict:
    """One tool's whole command, timed; its failure recorded, not hidden. A peer run that fails
    under load_quantizable_moe is run again with the model loaded plainly (oneshot linearizes
    it after loading), the first failure kept in the row."""
    row: dict = {"tool": tool}
    ids, out, log = work / "cal.npy", work / tool, work / f"{tool}.log"
    loads = ["quantizable", "plain"] if tool.startswith("peer") else ["quantizable"]
    for load in loads:
        shutil.rmtree(out, ignore_errors=True)
        try:
            row |= gb.timed(command(tool, source, out, ids, args, load), log)
        except RuntimeError:
            row[f"failed_{load}" if tool.startswith("peer") else "failed"] = _failure(log)
            print(f"{work.name} {tool}: FAILED ({load}): {_failure(log)}", flush=True)
            continue
        if tool.startswith("peer"):
            row["peer_load"] = load
        return row
    row.setdefault("failed", row.get("failed_plain"))
    return row


def causal_check(source: pathlib.Path, work: pathlib.Path, pipeline: str) -> dict:
    """peer_causal's answer for the peer's `pipeline` (default: sequential, or basic)."""
    found = subprocess.run(
        [sys.executable, __file__, "peer-causal", str(source), str(work / "cal.npy"), pipeline],
        capture_output=True,
        text=True,
    )
    if found.returncode:
        return {"failed": found.stderr.strip().splitlines()[-1]}
    answer = json.loads(found.stdout.strip().splitlines()[-1])
    print(f"{work.name}: the peer's layer-0 attention ({pipeline} pipeline): {answer}", flush=True)
    return answer


def compare(runs: list[dict], logits: dict, ref, found: dict, peer: str) -> None:
    """Each run against the `peer` run: the logits' distance, over the peer's own distance to
    the source's logits; the run's distance to the source's over the peer's; the share of equal
    4-bit codes, over every linear and over layer 0's q/k/v (the same input for every tool), and
    of equal group scales."""
    peer_error = rd.distance(logits[peer], ref)
    for row in runs:
        if row["tool"] in logits:
            gap = rd.distance(logits[row["tool"]], logits[peer])
            row[f"logits_vs_{peer}"] = gap
            row[f"vs_{peer}_over_{peer}_error"] = round(gap / peer_error, 4)
            row[f"error_over_{peer}_error"] = round(row["logits_vs_source"] / peer_error, 4)
            row[f"codes_same_as_{peer}"] = rd.same_codes(found[row["tool"]], found[peer])
            row[f"scales_same_as_{peer}"] = rd.same_scales(found[row["tool"]], found[peer])
            row[f"layer0_qkv_codes_same_as_{peer}"] = rd.same_codes(
                found[row["tool"]], found[peer], rd.LAYER0_QKV
            )


def prepare(name: str, args) -> tuple[pathlib.Path, pathlib.Path, dict]:
    """The model's work folder, its source folder and its config entry; ids written there."""
    import numpy as np

    from tests import lm_folder

    work = args.work / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    config_class, fields = model_fields(name)
    source = lm_folder.write(work / "source", config_class, fields)
    rng = np.random.default_rng(args.seed)
    shapes = {"cal": (args.samples, args.seq_len), "eval": (args.eval_samples, args.seq_len)}
    for part, shape in shapes.items():
        np.save(work / f"{part}.npy", rng.integers(0, lm_folder.VOCAB, shape).astype(np.int32))
    return work, source, {"config": config_class, "fields": fields}


def bench_model(name: str, args, doc: dict, save) -> None:
    """One model's folder, runs and comparisons, saved as they come."""
    import numpy as np

    work, source, entry = prepare(name, args)
    held_out = np.load(work / "eval.npy")
    ref, source_ppl, _ = rd.forward(source, held_out)
    entry["source_ppl"] = round(source_ppl, 4)
    entry["peer_layer0_attention"] = {p: causal_check(source, work, p) for p in args.causal_check}
    entry["runs"] = runs = []
    doc["models"][name] = entry
    hessian = rd.layer0_hessian(source, np.load(work / "cal.npy"))
    logits, found = {}, {}
    for tool in args.tools:
        row = run_tool(tool, source, work, args)
        runs.append(row)
        if "failed" not in row:
            out = work / tool
            logits[tool], ppl, how = rd.forward(out, held_out)
            row |= {"ppl": round(ppl, 4), "logits_vs_source": rd.distance(logits[tool], ref)}
            row |= how | rd.inspect(out)
            found[tool] = rd.codes(out)
            if tool != "rtn":
                agreement = rd.peer_function_agreement(
                    source, found[tool], hessian, args.group_size
                )
                row["layer0_qkv_codes_as_peer_gptq_function"] = agreement
            print(
                f"{name} {tool:11} {row['wall_s']:6.1f} s {row['peak_rss_mb']:7.1f} MB  "
                f"ppl {ppl:.4f}  |d source| {row['logits_vs_source']:.5f}",
                flush=True,
            )
        save()
    for peer in ("peer", "peer-basic"):
        if peer in logits:
            compare(runs, logits, ref, found, peer)
    save()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "peer-causal":
        peer_causal(*sys.argv[2:5])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "peer-gptq":
        peer_gptq(*sys.argv[2:5], int(sys.argv[5]), *sys.argv[6:10])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mixtral,qwen3_moe")
    parser.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated of {TOOLS}")
    parser.add_argument("--samples", type=int, default=16, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per window")
    parser.add_argument("--eval-samples", type=int, default=8, help="held-out windows")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument(
        "--peer-dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="the dtype the peer loads the model in (bfloat16: the folder's, as oneshot's "
        'precision="auto" loads it)',
    )
    parser.add_argument(
        "--causal-check",
        default="default,basic",
        help="the peer pipelines whose layer-0 attention is checked for its causal mask",
    )
    parser.add_argument("--seed", type=int, default=0, help="of the token ids")
    parser.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/lm-moe-peer"))
    parser.add_argument(
        "--json", type=pathlib.Path, default=ROOT / "bench" / "results" / "lm-moe-peer.json"
    )
    args = parser.parse_args()
    args.tools = [t for t in args.tools.split(",") if t]
    args.causal_check = [p for p in args.causal_check.split(",") if p]
    if unknown := set(args.tools) - set(TOOLS):
        parser.error(f"unknown tools {sorted(unknown)}: {', '.join(TOOLS)}")
    sys.path.insert(0, str(ROOT))
    doc = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": gb.machine(),
        "versions": gb.versions(),
        "calibration": {"samples": args.samples, "seq_len": args.seq_len, "seed": args.seed},
        "evaluation": {"samples": args.eval_samples, "seq_len": args.seq_len},
        "scheme": "W4A16",
        "group_size": args.group_size,
        "peer_ignore": ["lm_head", *ROUTERS],
        "peer_dtype": args.peer_dtype,
        "models": {},
    }

    def save() -> None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")

    for name in args.models.split(","):
        bench_model(name, args, doc, save)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
