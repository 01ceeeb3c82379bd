"""The mixture-of-experts forward pass (engine/lm/moe.py) against transformers': Mixtral,
Qwen3-MoE (with a dense layer among its sparse ones) and Qwen2-MoE (its shared expert), each a
tiny random model transformers builds and saves, give the same logits and loss."""

from __future__ import annotations

import pathlib

import pytest

from tests import lm_folder
from tests.engine.lm import hf_pair

SMALL = lm_folder.MOE_SMALL
CASES = {
    "mixtral": ("MixtralConfig", dict(lm_folder.MIXTRAL, num_experts_per_tok=2)),
    # Layer 0 a dense MLP (mlp_only_layers), layer 1 sparse; probabilities renormalized.
    "qwen3_moe": ("Qwen3MoeConfig", dict(lm_folder.QWEN3_MOE, num_experts_per_tok=3)),
    # Not renormalized; a shared expert gated by a sigmoid.
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            SMALL,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
        ),
    ),
}


def saved(name: str, root: pathlib.Path):
    """(transformers' model, config.json, {name: float32 array}) of a tiny random CASES model."""
    import torch
    import transformers

    config_class, kwargs = CASES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    # Random routers this small send most tokens to one or two experts: spread them out.
    with torch.no_grad():
        for p_name, p in model.named_parameters():
            if p_name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return (model, *hf_pair.save(model, root / name))


# Qwen2-MoE in the full run only: its shared expert is the one thing the other two lack.
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "qwen2_moe" else n for n in CASES]
)
def test_logits_and_loss_equal_transformers(name, tmp_path):
    model, config, tensors = saved(name, tmp_path)
    pair = hf_pair.compare(model, config, tensors)
    # As the dense architectures (forward_test.py): float32 on both sides, summation order
    # only; the routing is the same discrete choice on both sides (no two probabilities of a
    # token within rounding of each other here), so the bound is the dense one, 1e-5 of the
    # largest logit. Measured: at most 3.7e-7; a wrong detail moves it far more: the top-k
    # probabilities renormalized where the config says not (or the reverse) 4.9e-3 to 1.6e-2,
    # Qwen2-MoE's shared expert left out 7.8e-2.
    err = pair.logits_error
    assert err <= 1e-5, f"{name}: max |diff| / max |logit| = {err:.2e}"
    loss = pair.out.loss.item()
    assert abs(pair.token_nll().mean() - loss) <= 1e-5 * loss
    # Our names are every tensor of the checkpoint, no more.
    assert hf_pair.tensor_names(pair.cfg) == set(tensors)
