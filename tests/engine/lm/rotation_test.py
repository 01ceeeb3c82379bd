"""The Hadamard rotation fused into a causal LM's weights (engine/lm/rotation.py) on models of
random weights made from config.json dicts (no transformers): the float model's logits are
unchanged for every architecture it takes (GQA with biases, fused qkv / gate_up, q/k norms,
Gemma's (1 + w) norms and embedding scale, a tied head), Q is orthogonal with the block the
docs name, the same seed gives the same bytes, and what does not fuse is refused.
tests/interop/lm_hadamard_test.py runs it through `qmill quantize` and transformers."""

from __future__ import annotations

import numpy as np
import pytest

from qmill.engine.lm import config as config_lib
from qmill.engine.lm import forward, rotation
from tests import lm_folder
from tests.engine.lm import smoothing_test as random_layers

# One layer: the stream it writes is read by the final norm and the head, as by a next layer.
SMALL = dict(random_layers.SMALL, tie_word_embeddings=False)
ARCHS = {
    # GQA, q/k/v and o biases (Qwen2's q/k/v biases are these), MLP biases; the head tied.
    "llama_gqa_biases_tied": dict(
        model_type="llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=True
    ),
    "phi3_fused": dict(model_type="phi3"),
    "qwen3_qk_norms": dict(model_type="qwen3"),
    # (1 + w) norms and the embedding scaled by sqrt(hidden).
    "gemma_plus_one": dict(model_type="gemma"),
    "gemma2_sandwich": random_layers.ARCHS["gemma2_sandwich"],
}
FUSED = [a for a in ARCHS if a != "gemma2_sandwich"]


def _config(arch: str) -> config_lib.LmConfig:
    return config_lib.from_hf_config({**SMALL, **ARCHS[arch]})


def _model(cfg: config_lib.LmConfig) -> tuple[dict, list[dict]]:
    """Random float32 outer tensors and decoder layers (norm weights away from one, so that a
    norm left unfolded would show)."""
    rng = np.random.default_rng(7)
    d = cfg.hidden_size
    outer = {
        "embed": rng.normal(0.0, 1.0, (cfg.vocab_size, d)).astype(np.float32),
        "norm": (rng.normal(0.0, 0.3, d) + (0.0 if cfg.norm_plus_one else 1.0)),
    }
    outer["norm"] = outer["norm"].astype(np.float32)
    if not cfg.tied:
        outer["head"] = rng.normal(0.0, 0.2, (cfg.vocab_size, d)).astype(np.float32)
    layers = [random_layers._weights(cfg, seed=i) for i in range(cfg.num_layers)]
    return outer, layers


def _logits(cfg, outer, layers, ids) -> np.ndarray:
    h = forward.embed(cfg, outer, ids)
    for i, weights in enumerate(layers):
        h = forward.layer_forward(cfg, i, weights, h)
    return np.asarray(forward.logits(cfg, outer, h))


@pytest.mark.parametrize("arch", FUSED)
def test_the_rotation_leaves_the_float_models_logits_unchanged(arch):
    cfg = _config(arch)
    outer, layers = _model(cfg)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    before = _logits(cfg, outer, layers, ids)
    rot = rotation.rotation(cfg.hidden_size, seed=5)
    rotated = [{**w, **rotation.rotate_layer(cfg, w, rot)} for w in layers]
    after = _logits(rotation.untied(cfg), rotation.rotate_outer(cfg, outer, rot), rotated, ids)
    fill = 0.0 if cfg.norm_plus_one else 1.0
    for weights in rotated:
        assert np.all(np.asarray(weights["input_layernorm.weight"]) == fill)
        assert np.all(np.asarray(weights["post_attention_layernorm.weight"]) == fill)
    # float32: each rotated weight is a sum of 64 products (~2^-24 · 8 relative each), and the
    # layer and the head add up a few hundred of them per logit; measured ≤ 1.4e-6 of the
    # largest logit on these models, while a missed norm, bias or block moves logits by tens of
    # percent.
    assert np.max(np.abs(after - before)) <= 1e-5 * np.max(np.abs(before)), arch


def test_q_is_orthogonal_block_diagonal_with_signs_from_the_seed():
    rot = rotation.rotation(576, seed=0)  # SmolLM2's hidden size: 9 blocks of 64
    q = rot.matrix()
    assert rot.hadamard.shape == (64, 64)
    np.testing.assert_allclose(q.T @ q, np.eye(576), atol=1e-6)
    assert np.all(np.count_nonzero(q, axis=1) == 64)
    assert np.allclose(np.abs(q[q != 0]), 1 / 8)
    again = rotation.rotation(576, seed=0)
    assert again.signs.tobytes() == rot.signs.tobytes()
    assert rotation.rotation(576, seed=1).signs.tobytes() != rot.signs.tobytes()


def test_what_does_not_fuse_is_refused():
    with pytest.raises(ValueError, match="post_feedforward_layernorm"):
        rotation.check(_config("gemma2_sandwich"))
    mixtral = dict(lm_folder.MIXTRAL, model_type="mixtral", num_experts_per_tok=2)
    mixtral = config_lib.from_hf_config(mixtral)
    with pytest.raises(ValueError, match="has experts"):
        rotation.check(mixtral)
    with pytest.raises(ValueError, match="largest power-of-two factor of 4"):
        rotation.block_size(12)
    assert rotation.block_size(3 * 256) == 256
