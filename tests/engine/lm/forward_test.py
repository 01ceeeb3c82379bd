"""engine/lm's forward pass against transformers' own: every supported architecture, built by
transformers from a tiny config with random weights, must give the same logits and loss.

Needs the `interop` extra (torch CPU, transformers), as tests/interop does.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from qmill.engine.lm import config as config_lib
from qmill.engine.lm import forward

B, T = 2, 16
SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Short, so that T=16 positions cross every band of the ramp.
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
PHI3 = dict(SMALL, pad_token_id=0)  # its default pad id, 32000, is past this vocabulary

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
        dict(PHI3, max_position_embeddings=64, rope_parameters=dict(LONGROPE, rope_theta=1e4)),
    ),
    "gemma": ("GemmaConfig", dict(GEMMA)),
    "gemma2": (
        "Gemma2Config",
        # Caps small enough that tanh bends these random weights' scores and logits.
        dict(
            GEMMA,
            sliding_window=5,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=0.5,
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
}


def _model(name: str):
    import torch
    import transformers

    class_name, kwargs = CASES[name]
    hf_config = getattr(transformers, class_name)(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():  # norms start at 1 (Gemma: 0); random ones test their arithmetic
        for key, param in model.named_parameters():
            if "norm" in key:
                param.add_(0.5 * torch.randn_like(param))
    return hf_config, model


def _ours(cfg, state: dict[str, np.ndarray], ids: np.ndarray):
    names = config_lib.outer_tensor_names(cfg)
    outer = {k: jnp.asarray(state[v]) for k, v in names.items() if v is not None}
    h = forward.embed(cfg, outer, jnp.asarray(ids))
    for i in range(cfg.num_layers):
        prefix = config_lib.layer_prefix(cfg, i)
        weights = {
            n[len(prefix) :]: jnp.asarray(state[n]) for n in config_lib.layer_tensor_names(cfg, i)
        }
        h = forward.layer_forward(cfg, i, weights, h)
    return outer, h


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_loss_equal_transformers(name):
    import torch

    hf_config, model = _model(name)
    cfg = config_lib.from_hf_config(json.loads(hf_config.to_json_string()))
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    with torch.no_grad():
        out = model(torch.from_numpy(ids).long(), labels=torch.from_numpy(ids).long())
    theirs = out.logits.numpy()
    outer, h = _ours(cfg, state, ids)
    ours = np.asarray(forward.logits(cfg, outer, h))
    err = np.abs(ours - theirs).max() / np.abs(theirs).max()
    print(f"{name}: max |diff| / max |logit| = {err:.2e}")
    assert err <= 1e-5
    nll = np.asarray(forward.token_nll(cfg, outer, h, jnp.asarray(ids), chunk=5))
    assert nll.shape == (B, T - 1)
    assert abs(nll.mean() - out.loss.item()) <= 1e-5 * out.loss.item()
