import pytest

from qmill.proto import recipe
from qmill.proto.v1 import qmill_pb2 as pb


def test_mapping_round_trips_through_the_message():
    fields = {
        "convention": "torch",
        "rules": [
            {"path_regex": ".*embed.*", "skip": True},
            {
                "path_regex": ".*",
                "qtype": "int4",
                "tiled_axes": {1: 32},
                "calibration_method": "minmax",
            },
            {"path_regex": "x", "qtype": "int8", "contracting_axes": [0], "channel_axes": []},
        ],
    }
    message = recipe.from_mapping(fields)
    assert message.convention == pb.CONVENTION_TORCH
    assert message.rules[2].override_layout and list(message.rules[2].channel_axes) == []
    assert recipe.to_mapping(message) == fields


def test_unknown_rule_field_is_named():
    with pytest.raises(ValueError, match=r"rule 0: unknown field\(s\) \['bits'\]"):
        recipe.from_mapping({"rules": [{"qtype": "int8", "bits": 8}]})


def test_wrong_value_type_is_named():
    with pytest.raises(ValueError, match="rule 0"):
        recipe.from_mapping({"rules": [{"tile_size": "big"}]})


def test_unknown_convention():
    with pytest.raises(ValueError, match="convention 'jax'"):
        recipe.from_mapping({"convention": "jax", "rules": []})
