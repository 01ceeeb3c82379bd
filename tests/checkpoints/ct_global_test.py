"""NVFP4's global scales (checkpoints/formats/compressed_tensors/global_scales.py): the fused
sets, the scale's rounding, and the rules that carry it through the recipe and the wire. The
equality with llm-compressor's output is tests/interop/ct_write_test.py's."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from qmill.checkpoints.formats.compressed_tensors import global_scales as ct_global
from qmill.engine.modelfree import recipes
from qmill.proto import recipe as recipe_proto

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_fused_sets_and_the_shard_their_partners_go_to():
    paths = [
        f"model.layers.{i}.{m}.weight"
        for i in (10, 2)
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    sets = ct_global.fused_sets(paths)
    assert sets[0] == [f"model.layers.2.self_attn.{p}_proj.weight" for p in "qkv"]  # natural order
    assert [len(s) for s in sets] == [3, 3, 2, 2]
    homes = ct_global.partner_homes(paths)
    assert homes["model.layers.10.mlp.up_proj.weight"] == "model.layers.10.mlp.gate_proj.weight"
    assert (
        homes["model.layers.2.self_attn.v_proj.weight"] == "model.layers.2.self_attn.q_proj.weight"
    )
    assert len(homes) == 6  # k, v and up of each layer; o_proj and down_proj stand alone


def test_global_scale_rounds_as_pytorch_divides_a_scalar_by_a_tensor():
    # (1 / absmax) rounded to bf16, times 2688 rounded to bf16: not 2688 / absmax rounded once.
    absmax = 0.08544921875  # a bf16 value
    assert ct_global.global_scale(absmax, BF16) == 31360.0
    once = float(np.float32(2688 / absmax).astype(BF16))
    assert once != 31360.0
    assert ct_global.global_scale(0.0, BF16) == 1.0  # all zero: no global scaling
    # float16: 2688 / 0.01 overflows float16, which PyTorch then replaces by 1.
    assert ct_global.global_scale(0.01, np.dtype(np.float16)) == 1.0
    assert ct_global.global_scale(0.5, np.dtype(np.float32)) == 5376.0


def test_global_scale_rules_travel_through_the_wire_and_are_checked():
    rule = {"path_regex": r"a\.q_proj\.weight", "qtype": "nvfp4", "tiled_axes": {1: 16}}
    recipe = {"convention": "torch", "rules": [{**rule, "global_scale": 31360.0}]}
    back = recipe_proto.to_mapping(recipe_proto.from_mapping(recipe))
    assert back["rules"][0]["global_scale"] == 31360.0
    assert ct_global.global_scales(back) == {"a.q_proj.weight": 31360.0}
    with pytest.raises(ValueError, match="global_scale applies to qtype nvfp4 only"):
        recipes.rule_from_mapping({**rule, "qtype": "mxfp4", "global_scale": 2.0})
    with pytest.raises(ValueError, match="finite and positive"):
        recipes.rule_from_mapping({**rule, "global_scale": -1.0})
