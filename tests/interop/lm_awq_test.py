"""`qmill quantize FOLDER --method awq | smoothquant+gptq` on a small Llama transformers writes,
with a few outlier channels as real language models have (the norms before q/k/v and gate/up
scale 4 of 64 channels by 8): the output is a plain compressed-tensors folder (the tensors of a
round-to-nearest output, the norms folded) that transformers loads with the perplexity qmill
reported, and AWQ's logits are closer to the float model's than round to nearest's."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from qmill.cli import main as cli

VOCAB, LAYERS = 256, 2
OUTLIERS = [3, 17, 40, 51]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> pathlib.Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[OUTLIERS] *= 8.0
    folder = tmp_path_factory.mktemp("lm") / "llama"
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def ids(tmp_path_factory) -> dict[str, pathlib.Path]:
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("ids")
    out = {}
    for name, shape in (("calibration", (16, 32)), ("eval", (8, 32))):
        out[name] = root / f"{name}.npy"
        np.save(out[name], rng.integers(0, VOCAB, shape).astype(np.int32))
    return out


def _quantize(llama, ids, output: pathlib.Path, recipe: str, *method: str) -> dict:
    report = output.with_suffix(".json")
    calibration = ["--calibration-ids", str(ids["calibration"]), "--eval-ids", str(ids["eval"])]
    args = ["quantize", str(llama), "-o", str(output), "--recipe", recipe, "-q"]
    args += ["--group-size", "32"] if recipe == "W4A16" else []
    args += [*method, *calibration] if method else []
    assert cli.main([*args, "--report-json", str(report)]) == 0
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def runs(llama, ids, tmp_path_factory) -> dict[str, tuple[pathlib.Path, dict]]:
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for name, recipe, method in (
        ("rtn", "W4A16", ()),
        ("awq", "W4A16", ("--method", "awq")),
        ("sq", "W8A8", ("--method", "smoothquant+gptq")),
    ):
        out[name] = (root / name, _quantize(llama, ids, root / name, recipe, *method))
    return out


def _model(folder: pathlib.Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _run(folder: pathlib.Path, ids: np.ndarray) -> tuple[float, np.ndarray]:
    import torch

    tokens = torch.tensor(ids, dtype=torch.long)
    with torch.no_grad():
        out = _model(folder)(tokens, labels=tokens)
    return float(np.exp(out.loss.item())), out.logits.numpy()


def _tensors(folder: pathlib.Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "np") as f:
        names = f.keys()
        return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in names}


def test_awq_writes_a_plain_compressed_tensors_folder_with_the_norms_folded(runs, llama):
    (rtn, _), (awq, report) = runs["rtn"], runs["awq"]
    # The same tensors as round to nearest's output, no scale beside a weight; the same config.
    assert _tensors(awq) == _tensors(rtn)
    config = json.loads((awq / "config.json").read_text())["quantization_config"]
    assert config == json.loads((rtn / "config.json").read_text())["quantization_config"]
    methods = {row["path"]: row["method"] for row in report["tensors"]}
    assert sorted(p for p, m in methods.items() if m == "AWQ") == sorted(
        p for p in methods if p.endswith("proj.weight")
    )
    assert len([m for m in methods.values() if m == "AWQ"]) == 7 * LAYERS
    source, quantized = _model(llama).state_dict(), _model(awq).state_dict()
    norms = [k for k in source if k.endswith("layernorm.weight")]
    assert all(not np.array_equal(source[k], quantized[k]) for k in norms)  # folded
    assert np.array_equal(source["model.norm.weight"], quantized["model.norm.weight"])
    folds = [fold for entry in report["calibration"]["layers"] for fold in entry["smoothing"]]
    assert len(folds) == 4 * LAYERS
    assert all(fold["error"] <= fold["rtn_error"] for fold in folds), folds


@pytest.mark.parametrize("name", ["awq", "sq"])
def test_transformers_measures_the_reported_perplexity(runs, ids, name):
    output, report = runs[name]
    ppl, _ = _run(output, np.load(ids["eval"]))
    # float32 on both sides from the same codes × scales, and for W8A8 the same per-token int8
    # input quantization (which transformers applies as compressed-tensors' forward does); qmill
    # multiplies codes × scale in the scale's bf16 (a bf16 model's), transformers in float32
    # here: int8 codes carry 7 bits, so that rounding shows at ~1e-4 for W8A8.
    assert report["perplexity"]["quantized"] == pytest.approx(
        ppl, rel=1e-4 if name == "awq" else 3e-4
    )
    assert report["perplexity"]["quantized"] != report["perplexity"]["source"]


def test_awq_logits_are_closer_to_the_float_models_than_round_to_nearests(runs, llama, ids):
    calibration = np.load(ids["calibration"])
    _, reference = _run(llama, calibration)
    errors = {}
    for name in ("rtn", "awq"):
        errors[name] = float(np.mean((_run(runs[name][0], calibration)[1] - reference) ** 2))
    # Measured 8 % lower here (the outlier channels are what AWQ protects); without them, as
    # GPTQ's test model has none, AWQ's grid settles near s = 1 and the two are within 0.5 %.
    assert errors["awq"] < 0.95 * errors["rtn"], errors


def test_smoothquant_gptq_is_plain_w8a8_with_dynamic_token_activations(runs):
    output, report = runs["sq"]
    group = json.loads((output / "config.json").read_text())["quantization_config"]
    group = group["config_groups"]["W8A8"]
    assert group["input_activations"]["dynamic"] is True
    assert group["input_activations"]["strategy"] == "token"
    methods = {row["path"]: row["method"] for row in report["tensors"]}
    # q/k/v and gate/up take the smoothed input; o_proj and down_proj are GPTQ'd alone.
    linears = {p: m for p, m in methods.items() if p.endswith("proj.weight")}
    assert {m for p, m in linears.items() if "o_proj" in p or "down" in p} == {"GPTQ"}
    assert {m for p, m in linears.items() if "o_proj" not in p and "down" not in p} == {
        "SmoothQuant+GPTQ"
    }
    assert report["calibration"]["smoothquant"] == {"alpha": 0.5}
