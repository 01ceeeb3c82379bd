"""Model-free layout inference and the plan each tensor gets."""

import ml_dtypes
import numpy as np
import pytest

from qmill.engine.modelfree import layout, recipes


def _recipe(convention="auto", **rule):
    return recipes.recipe_from_mapping(
        {"convention": convention, "rules": [{"qtype": "int8", **rule}]}
    )


@pytest.mark.parametrize(
    ("path", "shape", "convention", "channels", "tiled"),
    [
        ("params/Dense_0/kernel", (64, 128), "flax", (1,), ((0, 32),)),
        ("params/Conv_0/kernel", (3, 3, 64, 16), "flax", (3,), ((2, 32),)),
        ("params/attn/query/kernel", (64, 4, 16), "flax", (1, 2), ((0, 32),)),
        ("params/Conv1d/kernel", (5, 64, 16), "flax", (2,), ((1, 32),)),
        ("params/Embed_0/embedding", (100, 64), "flax", (0,), ((1, 32),)),
        ("model.layers.0.mlp.up_proj.weight", (128, 64), "torch", (0,), ((1, 32),)),
        ("model.embed_tokens.weight", (100, 64), "torch", (0,), ((1, 32),)),
        ("conv1.weight", (16, 64, 3, 3), "torch", (0,), ((1, 32),)),
        ("w_out", (8, 64), "torch", (0,), ((1, 32),)),
        ("w_out", (64, 8), "flax", (1,), ((0, 32),)),
    ],
)
def test_inferred_layouts(path, shape, convention, channels, tiled):
    plan = layout.plan_leaf(path, shape, np.float32, _recipe(convention, tile_size=32))
    assert plan.quantize
    assert plan.channelwise_axes == channels
    assert plan.tiled_axes == tiled


@pytest.mark.parametrize(
    ("dtype", "shape", "reason"),
    [
        (np.int32, (4, 4), "int32 tensors are never quantized"),
        (np.bool_, (4, 4), "bool tensors are never quantized"),
        (ml_dtypes.float8_e4m3fn, (4, 4), "float8_e4m3fn tensors are never quantized"),
        (np.float32, (4,), "vectors and scalars stay in float"),
        (np.float32, (), "vectors and scalars stay in float"),
    ],
)
def test_kept_tensors_say_why(dtype, shape, reason):
    plan = layout.plan_leaf("params/x", shape, dtype, _recipe())
    assert not plan.quantize
    assert reason in plan.reason


def test_first_full_match_wins_and_skip():
    recipe = recipes.recipe_from_mapping(
        {
            "rules": [
                {"path_regex": ".*embedding", "skip": True},
                {"path_regex": "params/Dense.*", "qtype": "int4"},
                {"path_regex": ".*", "qtype": "int8"},
            ]
        }
    )
    assert (
        "skipped" in layout.plan_leaf("params/Embed_0/embedding", (8, 8), np.float32, recipe).reason
    )
    assert layout.plan_leaf("params/Dense_0/kernel", (8, 8), np.float32, recipe).qtype == "int4"
    # A partial match is not enough: "Dense" must match the whole path.
    assert layout.plan_leaf("x/params/Dense_0/kernel", (8, 8), np.float32, recipe).qtype == "int8"


def test_no_matching_rule_keeps_the_tensor():
    recipe = recipes.recipe_from_mapping({"rules": [{"path_regex": "only/this", "qtype": "int8"}]})
    assert layout.plan_leaf("other", (8, 8), np.float32, recipe).reason == "no rule matches"


def test_layout_override_and_vectors():
    plan = layout.plan_leaf(
        "w",
        (6, 8),
        np.float32,
        _recipe(contracting_axes=[1], channel_axes=[-2], tiled_axes={"1": 4}),
    )
    assert plan.channelwise_axes == (0,) and plan.tiled_axes == ((1, 4),)
    vec = layout.plan_leaf("b", (8,), np.float32, _recipe(include_vectors=True))
    assert vec.quantize and vec.channelwise_axes == () and vec.tiled_axes == ()


def test_tile_that_does_not_divide_is_an_error_unless_allowed():
    with pytest.raises(
        ValueError, match="tile size 32 does not divide axis 0 of shape \\[48, 8\\]"
    ):
        layout.plan_leaf("k/kernel", (48, 8), np.float32, _recipe(tile_size=32))
    plan = layout.plan_leaf(
        "k/kernel", (48, 8), np.float32, _recipe(tile_size=32, tile_if_divisible=True)
    )
    assert plan.tiled_axes == () and plan.channelwise_axes == (1,)


def test_axis_out_of_range_is_named():
    with pytest.raises(ValueError, match="axis 5 is out of range"):
        layout.plan_leaf("w", (4, 4), np.float32, _recipe(contracting_axes=[5], channel_axes=[0]))


@pytest.mark.parametrize("shape", [(4, 0), (0, 0), (0, 4), (0,)])
def test_an_empty_tensor_is_kept_with_a_reason(shape):
    recipe = recipes.recipe_from_mapping(
        {"rules": [{"qtype": "int8", "calibration_method": "rms,3", "include_vectors": True}]}
    )
    plan = layout.plan_leaf("params/w/kernel", shape, np.float32, recipe)
    assert not plan.quantize and "empty tensor" in plan.reason
