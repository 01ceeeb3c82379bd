"""AWQ and SmoothQuant folded into a decoder layer (engine/lm/folds.py, awq.py, smoothing.py) on
layers of random weights made from config.json dicts (no transformers): the folds leave the float
layer's function unchanged for every kind of fold, AWQ's search never loses to round to nearest
on the block it measures (its error, checked against a direct computation), and SmoothQuant
lowers the error of a W8A8 layer whose inputs have outlier channels. tests/interop/lm_awq_test.py
runs both through `qmill quantize` and transformers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qmill.engine.lm import activations, awq, folds, forward, sequential, smoothing
from qmill.engine.lm import config as config_lib
from qmill.engine.modelfree import layout, leaf, recipes
from tests import lm_folder

SMALL = dict(lm_folder.SMALL, num_hidden_layers=1, head_dim=16)
ARCHS = {
    # Grouped-query attention (v → o repeated per query head) and biases on v and up.
    "llama_gqa_biases": dict(model_type="llama", attention_bias=True, mlp_bias=True),
    # Fused qkv_proj and gate_up_proj: v and up are rows of them.
    "phi3_fused": dict(model_type="phi3"),
    # (1 + w) norms and sandwich norms: gate/up's input is pre_feedforward_layernorm's.
    "gemma2_sandwich": dict(model_type="gemma2", sliding_window=5, query_pre_attn_scalar=16),
    # q/k norms (AWQ leaves input_layernorm alone there: test_the_table_follows_...; its folds
    # are of the kinds above, so the exactness test leaves it out).
    "gemma3_qk_norms": dict(model_type="gemma3_text"),
}
EXACT = ("llama_gqa_biases", "phi3_fused", "gemma2_sandwich")
# tests/lm_folder.py's Llama (GQA, tied, 3 layers), whose config.json gives this LmConfig: the
# stages compiled here serve the interop and server tests of the same model, and theirs these.
LLAMA = dict(SMALL, model_type="llama", num_hidden_layers=3, tie_word_embeddings=True)
OUTLIERS = [3, 17, 40, 51]


def _config(arch: str) -> config_lib.LmConfig:
    return config_lib.from_hf_config(LLAMA if arch == "llama" else {**SMALL, **ARCHS[arch]})


def _shape(cfg: config_lib.LmConfig, name: str) -> tuple[int, ...]:
    hd, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    d, i = cfg.hidden_size, cfg.intermediate_size
    if name.endswith("norm.weight"):
        return (hd,) if "q_norm" in name or "k_norm" in name else (d,)
    rows = {
        "qkv_proj": (h + 2 * kv) * hd, "q_proj": h * hd, "k_proj": kv * hd, "v_proj": kv * hd,
        "o_proj": d, "gate_up_proj": 2 * i, "gate_proj": i, "up_proj": i, "down_proj": d,
    }  # fmt: skip
    module = name.split(".")[-2]
    columns = {"o_proj": h * hd, "down_proj": i}.get(module, d)
    return (rows[module], columns) if name.endswith("weight") else (rows[module],)


def _weights(cfg: config_lib.LmConfig, dtype=np.float32, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name in config_lib.relative_tensor_names(cfg):
        shape = _shape(cfg, name)
        if name.endswith("norm.weight"):
            value = rng.normal(0.0, 0.3, shape) + (0.0 if cfg.norm_plus_one else 1.0)
        else:
            value = rng.normal(0.0, 0.2, shape)
        out[name] = value.astype(dtype)
    return out


def _hidden(cfg: config_lib.LmConfig, outliers: float = 1.0, seed: int = 1) -> sequential.Hidden:
    """Four chunks of 4 windows of 32 tokens: the shapes `qmill quantize` gives the interop and
    server tests' 16 calibration windows (their compilations are these)."""
    h = np.random.default_rng(seed).normal(0.0, 1.0, (16, 32, cfg.hidden_size)).astype(np.float32)
    h[..., OUTLIERS] *= outliers
    return sequential.split(h, 4)


def _plans(cfg, weights, rule: dict) -> dict[str, layout.LeafPlan]:
    recipe = recipes.recipe_from_mapping({"convention": "torch", "rules": [rule]})
    names = config_lib.relative_linear_names(cfg)
    return {n: layout.plan_leaf(n, weights[n].shape, weights[n].dtype, recipe) for n in names}


W4 = {"path_regex": r".*", "qtype": "int4", "tile_size": 32, "arithmetic": "torch"}
W8 = {"path_regex": r".*", "qtype": "int8", "arithmetic": "torch"}


@pytest.mark.parametrize("arch", EXACT)
def test_folds_leave_the_float_layer_unchanged(arch):
    cfg = _config(arch)
    weights = _weights(cfg)
    (h,) = _hidden(cfg, seed=2)[:1]
    before = np.asarray(forward.layer_forward(cfg, 0, weights, h))
    rng = np.random.default_rng(3)
    folded = {n: jnp.asarray(w) for n, w in weights.items()}
    # Every fold of either method (SmoothQuant's are AWQ's first and third), each once.
    table = {f.name: f for m in folds.METHODS for f in folds.table(cfg, m)}.values()
    for fold in table:
        width = fold.channels or weights[fold.balance[0]].shape[-1]
        # Scales over e^±1.5: a fold that missed a row, a bias or a GQA slot would change the
        # layer's output by tens of percent.
        folded.update(folds.apply(folded, fold, np.exp(rng.uniform(-1.5, 1.5, width))))
    after = np.asarray(forward.layer_forward(cfg, 0, folded, h))
    changed = {n for n in weights if not np.array_equal(weights[n], np.asarray(folded[n]))}
    touched = {n for f in table for n in (*f.balance, f.smooth, f.bias) if n is not None}
    assert changed == touched  # each fold's tensors, nothing else
    # float32: each folded weight is rounded once (2^-24 relative) and the layer sums 64-128
    # products per output; measured ≤ 8e-7 of the output's largest value on these layers.
    assert np.max(np.abs(after - before)) <= 1e-5 * np.max(np.abs(before)), arch


def test_the_table_follows_each_architecture():
    gemma3 = [f.name for f in folds.table(_config("gemma3_qk_norms"), folds.AWQ)]
    assert gemma3 == ["attn_out", "mlp_in", "mlp_mid"]  # no fold before q/k norms (module doc)
    (mlp_in,) = [f for f in folds.table(_config("gemma2_sandwich"), "smoothquant") if f.stage == 2]
    assert mlp_in.smooth == "pre_feedforward_layernorm.weight"
    assert mlp_in.smooth_kind == "norm_plus_one"
    attn_out = folds.table(_config("llama_gqa_biases"), folds.AWQ)[1]
    assert attn_out.heads == (2, 2, 16) and attn_out.bias == "self_attn.v_proj.bias"
    fused = folds.table(_config("phi3_fused"), folds.AWQ)
    assert [f.rows for f in fused if f.smooth_kind == "linear"] == [(96, 128), (128, 256)]


def _rtn(weights, plans) -> dict[str, np.ndarray]:
    """Each planned weight rounded to nearest exactly as the pipeline writes it, dequantized."""
    out = {}
    for name, plan in plans.items():
        result = leaf.quantize_leaf(np.asarray(weights[name]), plan)
        codes, scale = result.codes().astype(np.float32), result.scale.astype(np.float32)
        group = codes.shape[1] // scale.shape[1]
        out[name] = (codes * np.repeat(scale, group, axis=1)).astype(weights[name].dtype)
    return out


def test_awq_search_never_loses_to_round_to_nearest_on_its_block():
    cfg = _config("llama")
    weights = _weights(cfg, ml_dtypes.bfloat16)
    hidden = _hidden(cfg, outliers=20.0)
    plans = _plans(cfg, weights, W4)
    options = awq.AwqOptions()
    # The search quantizes W · s as the fold keeps it, in float32 (s = 1: the bf16 weight's
    # float32 copy), and scores the float32 Q(W · s) / s.
    rtn = _rtn({n: w.astype(np.float32) for n, w in weights.items()}, plans)
    xs = [forward.stage_fn(cfg, 0, 0)(weights, {"h": h})["x"] for h in hidden]
    attn_in = folds.table(cfg, folds.AWQ)[0]
    _, info = awq.search(cfg, 0, attn_in, weights, xs, plans, options)
    # The grid's first point is s = 1: q/k/v rounded to nearest, on the output of the attention
    # and its (float) o_proj.
    run = awq.block(cfg, 0, attn_in)
    trial = {**weights, **{n: rtn[n] for n in attn_in.balance}}
    direct = np.mean([(np.asarray(run(trial, x)) - np.asarray(run(weights, x))) ** 2 for x in xs])
    assert info["rtn_error"] == pytest.approx(direct, rel=1e-5)
    assert info["error"] < 0.7 * info["rtn_error"], info  # the outlier channels protected

    # down_proj's error comes from H = Σ xᵀx instead of the tokens: the same number.
    stage = [forward.stage_fn(cfg, 0, i) for i in range(4)]
    carries = [{"h": h} for h in hidden]
    for f in stage:
        carries = [f(weights, c) for c in carries]
    down = [c["x"] for c in carries]
    mlp_mid = folds.table(cfg, folds.AWQ)[3]
    _, info = awq.search(cfg, 0, mlp_mid, weights, down, plans, options)
    w, w_hat = (np.asarray(a["mlp.down_proj.weight"], np.float32) for a in (weights, rtn))
    direct = np.mean([(np.asarray(x) @ (w - w_hat).T) ** 2 for x in down])
    assert info["rtn_error"] == pytest.approx(direct, rel=1e-4)
    assert info["error"] <= info["rtn_error"]


def test_smoothquant_lowers_the_w8a8_error_of_the_linears_it_balances():
    cfg = _config("llama")
    weights = _weights(cfg, ml_dtypes.bfloat16)
    hidden = _hidden(cfg, outliers=40.0)
    plans = _plans(cfg, weights, W8)
    options = smoothing.SmoothingOptions(method=folds.SMOOTHQUANT)
    smoothed, applied, _ = smoothing.smooth_layer(cfg, 0, weights, hidden, plans, options)
    assert [f.name for f in applied] == ["attn_in", "mlp_in"]
    qdq = jax.jit(activations.quantize_dequantize, static_argnums=0)
    int8 = config_lib.InputQuant(qtype="int8")

    def inputs(w, stage: int) -> np.ndarray:
        carries = [{"h": h} for h in hidden]
        for i in range(stage + 1):
            carries = [forward.stage_fn(cfg, 0, i)(w, c) for c in carries]
        return np.concatenate([np.asarray(c["x"]) for c in carries])

    for fold in applied:
        x = inputs(weights, fold.stage)
        errors = {}
        for name, (w, x_in) in {
            "rtn": (weights, x),
            "sq": (smoothed, inputs(smoothed, fold.stage)),
        }.items():
            balanced = {n: np.asarray(w[n]) for n in fold.balance}
            rtn = _rtn(balanced, {n: plans[n] for n in fold.balance})
            x_hat = np.asarray(qdq(int8, x_in))  # as a serving stack runs W8A8: per token
            errors[name] = sum(
                np.sum((x_hat @ rtn[n].astype(np.float32).T - x @ weights[n].astype(np.float32).T)
                       ** 2)
                for n in fold.balance
            )  # fmt: skip
        # Measured 0.20 (q/k/v) and 0.34 (gate/up) of round to nearest's error here.
        assert errors["sq"] < 0.5 * errors["rtn"], (fold.name, errors)


def test_dynamic_input_quantization_is_per_token_int8():
    x = np.random.default_rng(4).normal(0.0, 1.0, (2, 3, 64)).astype(np.float32)
    x[0, 1] *= 100.0  # one loud token: its own scale, the others' untouched
    qdq = jax.jit(activations.quantize_dequantize, static_argnums=0)  # as the forward runs it
    out = np.asarray(qdq(config_lib.InputQuant(qtype="int8"), x))
    scale = np.abs(x).max(axis=-1, keepdims=True) / 127.5
    assert np.allclose(out, np.clip(np.rint(x / scale), -128, 127) * scale, rtol=1e-6, atol=0)


def test_round_to_nearest_passes_the_float_layers_output_on():
    """Round to nearest after smoothing passes the float (smoothed) layer's output on, as
    llm-compressor's pipeline and AutoAWQ do: later layers search their scales on the float
    model's activations. (GPTQ passes the quantized layer's on, each linear fitted to the error
    of those before it: sequential.py.)"""
    cfg = _config("llama")
    weights = _weights(cfg, ml_dtypes.bfloat16)
    hidden = _hidden(cfg, outliers=20.0)
    plans = _plans(cfg, weights, W4)
    options = smoothing.SmoothingOptions(method=folds.AWQ, awq=awq.AwqOptions(n_grid=4))
    done = smoothing.calibrate_layer(cfg, 0, weights, hidden, plans, options, None)

    def output(w) -> np.ndarray:
        return np.concatenate([np.asarray(forward.layer_forward(cfg, 0, w, h)) for h in hidden])

    float_out, quantized_out = output(weights), output(done.weights)
    got = np.concatenate([np.asarray(h) for h in done.hidden])
    scale = np.max(np.abs(float_out))
    # The folds round each smoothed weight once to bf16 (2^-9 relative); int4 rounding moves
    # the output ~40 times more. Measured: 2.3e-3 of the largest value from the float output,
    # 9.1e-2 from the quantized one, which is 9.1e-2 from the float one.
    assert np.max(np.abs(got - float_out)) < 1e-2 * scale
    assert np.max(np.abs(quantized_out - float_out)) > 5e-2 * scale
