"""engine/lm/activation_ranges.py: each linear's input range, taken where the sequential run
hands a stage's input to its observer, on a tiny random Llama (no torch)."""

from __future__ import annotations

import numpy as np
import pytest

from qmill.engine.lm import activation_ranges, sequential
from qmill.engine.lm import config as config_lib

HIDDEN, INTER = 32, 64
CFG = config_lib.from_hf_config(
    {
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 64,
        "rms_norm_eps": 1e-6,
    }
)


def _weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    shapes = {
        "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
        "self_attn.k_proj.weight": (HIDDEN // 2, HIDDEN),
        "self_attn.v_proj.weight": (HIDDEN // 2, HIDDEN),
        "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        "mlp.gate_proj.weight": (INTER, HIDDEN),
        "mlp.up_proj.weight": (INTER, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, INTER),
        "input_layernorm.weight": (HIDDEN,),
        "post_attention_layernorm.weight": (HIDDEN,),
    }
    return {n: rng.normal(0, 0.2, s).astype(np.float32) for n, s in shapes.items()}


def test_ranges_are_the_stage_inputs_min_and_max_over_every_chunk():
    rng = np.random.default_rng(0)
    weights = _weights(rng)
    hidden = rng.normal(0, 1, (6, 5, HIDDEN)).astype(np.float32)
    hidden[4, 2, 7] = 40.0  # the extremes sit in the second chunk: chunks must merge
    ranges, out = activation_ranges.layer_ranges(CFG, 0, weights, sequential.split(hidden, 3))
    prefix = config_lib.layer_prefix(CFG, 0)
    assert sorted(ranges) == sorted(config_lib.linear_names(CFG, 0))
    # q/k/v share their input (the normed hidden state), as gate/up do: one range each.
    q, k, v = (ranges[f"{prefix}self_attn.{n}_proj.weight"] for n in "qkv")
    assert q == k == v
    assert ranges[f"{prefix}mlp.gate_proj.weight"] == ranges[f"{prefix}mlp.up_proj.weight"]
    assert ranges[f"{prefix}mlp.down_proj.weight"] != q
    # q's input computed here: RMSNorm of the hidden state, times its weight, in float32.
    normed = hidden / np.sqrt(np.mean(hidden**2, axis=-1, keepdims=True) + 1e-6)
    normed = normed * weights["input_layernorm.weight"]
    assert q == pytest.approx((normed.min(), normed.max()), rel=1e-5)
    assert [c.shape for c in out] == [(3, 5, HIDDEN)] * 2  # the layer's output, chunk by chunk


def test_merge_is_min_and_max_and_idempotent():
    ranges = activation_ranges.merge({}, ("a", "b"), (-1.0, 2.0))
    ranges = activation_ranges.merge(ranges, ("a",), (-3.0, 1.0))
    assert ranges == {"a": (-3.0, 2.0), "b": (-1.0, 2.0)}
    # A layer observed again (a resumed run) changes nothing.
    assert activation_ranges.merge(ranges, ("a",), (-3.0, 1.0)) == ranges
    with pytest.raises(ValueError, match="at least one chunk"):
        activation_ranges.input_range([])
