"""engine/lm's forward pass against transformers' own: every supported architecture, built by
transformers from a tiny config with random weights, must give the same logits and loss.

Needs the `interop` extra (torch CPU, transformers), as tests/interop does.
"""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qmill.engine.lm import config as config_lib
from qmill.engine.lm import forward
from qmill.engine.lm import rope as rope_lib
from tests import lm_folder, random_inputs
from tests.engine.lm import hf_pair

B, T = hf_pair.B, hf_pair.T
SMALL = lm_folder.SMALL
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Short, so that the 8 wavelengths of a 16-wide head (6.3, 32, 167, ...) fall in all three
    # bands: kept (< 64 / 4), smoothed, divided by the factor (> 64).
    "original_max_position_embeddings": 64,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
# Phi-3's LongRoPE: one divisor per rotated frequency; the long ones apply since T=16 > 8.
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0],
    "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0],
    "original_max_position_embeddings": 8,
}
GEMMA = dict(SMALL, head_dim=16)
# Its default pad and end ids, 32000, are past this vocabulary.
PHI3 = dict(SMALL, pad_token_id=0, eos_token_id=1)

# name -> (transformers config class, its keyword arguments)
CASES = {
    "llama": ("LlamaConfig", dict(SMALL)),
    "llama_tied_bias": (
        "LlamaConfig",
        dict(SMALL, tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    ),
    "llama_llama3": ("LlamaConfig", dict(SMALL, rope_parameters=dict(LLAMA3, rope_theta=5e5))),
    "llama_yarn": (
        "LlamaConfig",
        dict(SMALL, max_position_embeddings=128, rope_parameters=dict(YARN, rope_theta=1e4)),
    ),
    # max_position_embeddings < T: the base grows with the length.
    "llama_dynamic": (
        "LlamaConfig",
        dict(
            SMALL,
            max_position_embeddings=8,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
        ),
    ),
    "llama_linear": (
        "LlamaConfig",
        dict(SMALL, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
    ),
    "mistral_window": ("MistralConfig", dict(SMALL, sliding_window=5)),
    "qwen2_bias": ("Qwen2Config", dict(SMALL)),
    "qwen2_window_tied": (
        "Qwen2Config",
        dict(
            SMALL,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_qk_norm": ("Qwen3Config", dict(SMALL, head_dim=32)),
    "phi3_fused_partial": ("Phi3Config", dict(PHI3, partial_rotary_factor=0.5)),
    "phi3_longrope": (
        "Phi3Config",
        dict(
            PHI3,
            max_position_embeddings=64,
            # Phi3Config's top-level field wins over rope_parameters' (and defaults to 4096).
            original_max_position_embeddings=8,
            rope_parameters=dict(LONGROPE, rope_theta=1e4),
        ),
    ),
    "gemma": ("GemmaConfig", dict(GEMMA)),
    "gemma2": (
        "Gemma2Config",
        # Caps small enough that tanh bends these random weights' scores and logits.
        dict(
            GEMMA,
            sliding_window=5,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=0.05,
            final_logit_softcapping=2.0,
        ),
    ),
    "gemma2_untied": ("Gemma2Config", dict(GEMMA, sliding_window=5, tie_word_embeddings=False)),
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            GEMMA,
            num_hidden_layers=3,
            sliding_window=5,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
    # Gemma 3's multimodal folder (config.json nests text_config; language_model.* names).
    "gemma3_multimodal": (
        "Gemma3Config",
        dict(
            text_config=dict(GEMMA, sliding_window=5, query_pre_attn_scalar=24),
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=32,
                patch_size=8,
            ),
            mm_tokens_per_image=4,
        ),
    ),
}


def _saved(name: str, folder: pathlib.Path):
    """transformers' model of case `name` (random weights, float32, eager attention) and the
    config.json and tensors it saves to `folder`: what a user's Hugging Face folder holds."""
    import torch
    import transformers

    class_name, kwargs = CASES[name]
    hf_config = getattr(transformers, class_name)(**kwargs)
    torch.manual_seed(0)
    if class_name == "Gemma3Config":  # the multimodal model; its text part is ours
        hf_config._attn_implementation = "eager"
        model = transformers.Gemma3ForConditionalGeneration(hf_config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(
            hf_config, attn_implementation="eager", dtype=torch.float32
        )
    with torch.no_grad():  # norms start at 1 (Gemma: 0); random ones test their arithmetic
        for key, param in model.named_parameters():
            if "norm" in key:
                param.add_(0.5 * torch.randn_like(param))
    return (model, *hf_pair.save(model, folder))


def _rope_buffers(model, cfg) -> list[tuple[config_lib.Rope, object, float]]:
    """(our Rope, transformers' inv_freq buffer, its attention scaling) per kind of layer."""
    text_model = model.model.language_model if cfg.model_type == "gemma3" else model.model
    rotary = text_model.rotary_emb
    if hasattr(rotary, "inv_freq"):
        return [(cfg.rope, rotary.inv_freq, rotary.attention_scaling)]
    kinds = [("full_attention", cfg.rope), ("sliding_attention", cfg.rope_local)]
    return [
        (rope, getattr(rotary, f"{kind}_inv_freq"), getattr(rotary, f"{kind}_attention_scaling"))
        for kind, rope in kinds
        if kind in rotary.layer_types  # Gemma 3: the kinds its layers use
    ]


# The edit-test loop (-m 'not slow') runs three cases that cover most features between them;
# each case is 2-3 s of CPU (a compilation per kind of layer), the first one ~10 s more (torch).
QUICK = ("llama_tied_bias", "phi3_longrope", "gemma3_text")


@pytest.mark.parametrize(
    "name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in sorted(CASES)]
)
def test_logits_and_loss_equal_transformers(name, tmp_path):
    model, config, tensors = _saved(name, tmp_path)
    pair = hf_pair.compare(model, config, tensors)
    cfg, out = pair.cfg, pair.out
    # Both compute in float32 from the same weights; what differs is the order of summation
    # (XLA's dots and reductions against torch's), worth a few float32 ulps per operation.
    # Measured here: at most 9.2e-7 of the largest logit (Gemma 2, whose soft-caps add tanh's
    # rounding); 1e-5 leaves a 10x margin, while one wrong detail moves them by 2e-3 or more
    # of it (measured on these cases: dynamic rope read as default 2.1e-3, llama3 as default
    # 5.2e-3, yarn's cos/sin scaling left out 6e-3, longrope's short factors for its long ones
    # 8.6e-3, a soft-cap left out 3e-2, the window ignored or one longer 0.3, Gemma's norm
    # without its +1 1.3).
    err = pair.logits_error
    assert err <= 1e-5, f"{name}: max |diff| / max |logit| = {err:.2e}"
    nll = pair.token_nll(chunk=5)
    assert nll.shape == (B, T - 1)
    # transformers' loss is the mean next-token NLL (measured: within 1.8e-7 relative).
    assert abs(nll.mean() - out.loss.item()) <= 1e-5 * out.loss.item()
    # The rope of each kind of layer is transformers' (after the forward: dynamic and longrope
    # pick theirs by the length).
    for rope, inv_freq, scaling in _rope_buffers(model, cfg):
        ours_freq, ours_scaling = rope_lib.inv_freq(rope, cfg.head_dim, T)
        np.testing.assert_allclose(ours_freq, inv_freq.numpy(), rtol=1e-6)
        assert ours_scaling == pytest.approx(scaling, rel=1e-7)
    # Our names are every tensor of the text model, no more.
    names = hf_pair.tensor_names(cfg)
    text = {n for n in tensors if not n.startswith(("vision_tower.", "multi_modal_projector."))}
    assert names == text


# Phi-3: fused linears; Gemma 3: sandwich norms, q/k norms, sliding and full layers.
@pytest.mark.parametrize(
    "name", [pytest.param("phi3_fused_partial", marks=pytest.mark.slow), "gemma3_text"]
)
def test_stages_compose_to_the_layer_and_read_only_earlier_linears(name, tmp_path):
    _, config, tensors = _saved(name, tmp_path)
    cfg = config_lib.from_hf_config(config)
    h0 = random_inputs.normal(jax.random.key(0), (B, T, cfg.hidden_size), jnp.float32)
    for i in range(cfg.num_layers):
        weights = hf_pair.layer_weights(cfg, i, tensors)
        steps = forward.stages(cfg, i)
        assert not steps[-1].linears
        assert [n for s in steps for n in s.linears] == list(config_lib.relative_linear_names(cfg))
        carry, later = {"h": h0}, set(config_lib.relative_linear_names(cfg))
        for index, stage in enumerate(steps):
            # Without the linears of this stage and later ones: a stage that read one fails.
            visible = {k: v for k, v in weights.items() if k not in later}
            carry = forward.stage_fn(cfg, i, index)(visible, carry)
            for linear in stage.linears:
                assert carry["x"].shape == (B, T, weights[linear].shape[1])
            later -= set(stage.linears)
        expected = forward.layer_forward(cfg, i, weights, h0)
        # One jitted layer and five jitted stages are fused differently by XLA: the same
        # float32 arithmetic, rounded in other places (measured: 1.5e-6 on values of ~3).
        np.testing.assert_allclose(carry["h"], expected, rtol=1e-5, atol=1e-5)
        if i == 0:  # run_stage un-jitted gives the same
            eager = {"h": h0}
            for index in range(len(steps)):
                eager = forward.run_stage(cfg, i, index, weights, eager)
            np.testing.assert_allclose(eager["h"], expected, rtol=1e-5, atol=1e-5)


def test_an_unsupported_architecture_is_refused_naming_the_supported_ones():
    with pytest.raises(ValueError, match="'gpt2' is not supported") as raised:
        config_lib.from_hf_config({"model_type": "gpt2", "n_layer": 2})
    for model_type in config_lib.SUPPORTED:
        assert model_type in str(raised.value)


LLAMA_JSON = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 2048,
}


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"rope_scaling": {"rope_type": "proportional", "factor": 2.0}},
            "rope type 'proportional'",
        ),
        ({"hidden_act": "relu2"}, "activation 'relu2'"),
        ({"rope_scaling": {"rope_type": "linear"}}, "needs a factor"),
    ],
)
def test_what_the_forward_cannot_honour_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        config_lib.from_hf_config({**LLAMA_JSON, **change})
    with pytest.raises(ValueError, match="bidirectional"):
        config_lib.from_hf_config(
            {"model_type": "gemma3_text", "use_bidirectional_attention": True}
        )


def test_transformers_4_spelling_reads_as_transformers_5():
    # Hub config.json files written by transformers 4: rope_theta + rope_scaling ("type" in the
    # oldest), Gemma 3's rope_local_base_freq and sliding_window_pattern.
    v4 = {
        **LLAMA_JSON,
        "rope_theta": 5e5,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    }
    v5 = {**LLAMA_JSON, "rope_parameters": dict(LLAMA3, rope_theta=5e5)}
    assert config_lib.from_hf_config(v4) == config_lib.from_hf_config(v5)
    gemma3_v4 = {
        **dict(GEMMA, model_type="gemma3_text", num_hidden_layers=7),
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window_pattern": 6,
        "sliding_window": 512,
    }
    cfg = config_lib.from_hf_config(gemma3_v4)
    assert cfg.sliding_layers == (True,) * 5 + (False, True)
    assert (cfg.rope.kind, cfg.rope.theta, cfg.rope.factor) == ("linear", 1e6, 8.0)
    assert (cfg.rope_local.kind, cfg.rope_local.theta) == ("default", 1e4)


def test_gemma_normalizer_is_rounded_to_the_embedding_dtype():
    # transformers multiplies a bf16 embedding by sqrt(D) cast to bf16: sqrt(3072) = 55.4256...
    # is 55.5 in bf16; the float32 product of the bf16 values is what we compute.
    cfg = config_lib.from_hf_config(dict(GEMMA, model_type="gemma", hidden_size=3072))
    table = jnp.ones((4, 3072), jnp.bfloat16)
    h = forward.embed(cfg, {"embed": table}, jnp.zeros((1, 1), jnp.int32))
    assert h.dtype == jnp.float32
    assert float(h[0, 0, 0]) == 55.5


def test_importing_lm_imports_no_flax():
    code = (
        "import sys, qmill.engine.lm; "
        "sys.exit(1 if any(m.split('.')[0] in ('flax', 'optax') for m in sys.modules) else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_null_in_config_json_is_no_window_or_cap_but_missing_is_the_default():
    # Mistral 7B v0.2 and later write "sliding_window": null (no window); a Gemma 2 config
    # without soft-caps writes null for them. Only a field left out takes the class default.
    mistral = {**LLAMA_JSON, "model_type": "mistral", "head_dim": None}
    assert config_lib.from_hf_config({**mistral, "sliding_window": None}).sliding_window is None
    assert config_lib.from_hf_config(mistral).sliding_window == 4096
    assert config_lib.from_hf_config(mistral).head_dim == 16
    gemma2 = {**LLAMA_JSON, "model_type": "gemma2"}
    capped = config_lib.from_hf_config(gemma2)
    assert (capped.attn_softcap, capped.final_softcap) == (50.0, 30.0)
    nulls = {"attn_logit_softcapping": None, "final_logit_softcapping": None}
    uncapped = config_lib.from_hf_config({**gemma2, **nulls})
    assert (uncapped.attn_softcap, uncapped.final_softcap) == (None, None)


def test_attention_in_query_blocks_equals_attention_at_once(tmp_path):
    # Blocks of 5 queries over T=16: three whole blocks, one padded; a sliding window of 5.
    _, config, tensors = _saved("mistral_window", tmp_path)
    cfg = config_lib.from_hf_config(config)
    blocked = dataclasses.replace(cfg, attention_chunk=5)
    h = random_inputs.normal(jax.random.key(1), (B, T, cfg.hidden_size), jnp.float32)
    weights = hf_pair.layer_weights(cfg, 0, tensors)
    np.testing.assert_allclose(
        forward.layer_forward(blocked, 0, weights, h),
        forward.layer_forward(cfg, 0, weights, h),
        rtol=1e-5,
        atol=1e-5,
    )
