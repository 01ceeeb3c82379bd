"""engine/lm's forward pass against transformers' own: every supported architecture, built by
transformers from a tiny config with random weights, must give the same logits and loss.

Needs the `interop` extra (torch CPU, transformers), as tests/interop does.
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from qmill.engine.lm import config as config_lib
from qmill.engine.lm import forward
from qmill.engine.lm import rope as rope_lib

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
    from safetensors.numpy import load_file

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
    model.eval().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return model, config, tensors


def _outer(cfg, tensors: dict[str, np.ndarray]) -> dict[str, jnp.ndarray]:
    names = config_lib.outer_tensor_names(cfg)
    return {k: jnp.asarray(tensors[v]) for k, v in names.items() if v is not None}


def _layer(cfg, i: int, tensors: dict[str, np.ndarray]) -> dict[str, jnp.ndarray]:
    prefix = config_lib.layer_prefix(cfg, i)
    return {
        n[len(prefix) :]: jnp.asarray(tensors[n]) for n in config_lib.layer_tensor_names(cfg, i)
    }


def _ours(cfg, tensors: dict[str, np.ndarray], ids: np.ndarray):
    outer = _outer(cfg, tensors)
    h = forward.embed(cfg, outer, jnp.asarray(ids))
    for i in range(cfg.num_layers):
        h = forward.layer_forward(cfg, i, _layer(cfg, i, tensors), h)
    return outer, h


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


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_loss_equal_transformers(name, tmp_path):
    import torch

    model, config, tensors = _saved(name, tmp_path)
    cfg = config_lib.from_hf_config(config)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    with torch.no_grad():
        out = model(torch.from_numpy(ids).long(), labels=torch.from_numpy(ids).long())
    theirs = out.logits.numpy()
    outer, h = _ours(cfg, tensors, ids)
    ours = np.asarray(forward.logits(cfg, outer, h))
    # Both compute in float32 from the same weights; what differs is the order of summation
    # (XLA's dots and reductions against torch's), worth a few float32 ulps per operation.
    # Measured here: at most 9.2e-7 of the largest logit (Gemma 2, whose soft-caps add tanh's
    # rounding); 1e-5 leaves a 10x margin, while one wrong detail (a rope factor, a window
    # off by one, a norm without its +1) moves logits by 1e-2 or more of it.
    err = np.abs(ours - theirs).max() / np.abs(theirs).max()
    assert err <= 1e-5, f"{name}: max |diff| / max |logit| = {err:.2e}"
    nll = np.asarray(forward.token_nll(cfg, outer, h, jnp.asarray(ids), chunk=5))
    assert nll.shape == (B, T - 1)
    # transformers' loss is the mean next-token NLL; the same 1e-5 relative bound.
    assert abs(nll.mean() - out.loss.item()) <= 1e-5 * out.loss.item()
    # The rope of each kind of layer is transformers' (after the forward: dynamic and longrope
    # pick theirs by the length).
    for rope, inv_freq, scaling in _rope_buffers(model, cfg):
        ours_freq, ours_scaling = rope_lib.inv_freq(rope, cfg.head_dim, T)
        np.testing.assert_allclose(ours_freq, inv_freq.numpy(), rtol=1e-6)
        assert ours_scaling == pytest.approx(scaling, rel=1e-7)
    # Our names are every tensor of the text model, no more.
    names = {n for i in range(cfg.num_layers) for n in config_lib.layer_tensor_names(cfg, i)}
    names |= {n for n in config_lib.outer_tensor_names(cfg).values() if n is not None}
    text = {n for n in tensors if not n.startswith(("vision_tower.", "multi_modal_projector."))}
    assert names == text
