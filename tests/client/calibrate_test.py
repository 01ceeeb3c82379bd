"""Model rules for `qmill calibrate` (presets and TOML) and its .npy batches; no server, no jax."""

import numpy as np
import pytest

from qmill.cli import model_rules
from qmill.client import calibrate
from qmill.proto.v1 import qmill_pb2 as pb


def test_rule_fields_cover_the_proto():
    assert set(model_rules.RULE_FIELDS) == {f.name for f in pb.ModelRule.DESCRIPTOR.fields}


def test_a_toml_file_equals_the_preset_it_spells_out(tmp_path):
    path = tmp_path / "rules.toml"
    path.write_text(
        '[[rules]]\nmodule_path = "Dense_1"\nweight_qtype = "int8"\n\n'
        '[[rules]]\nweight_qtype = "int8"\nact_qtype = "int8"\nact_static_scale = true\n'
        'op_names = ["dot_general", "conv_general_dilated"]\n'
    )
    first, second = model_rules.load_rules(str(path))
    assert first == pb.ModelRule(module_path="Dense_1", weight_qtype="int8")
    assert second.act_static_scale and list(second.op_names)[1] == "conv_general_dilated"
    preset = model_rules.load_rules("w8a8-static")
    assert preset == [pb.ModelRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]
    preset[0].weight_qtype = "int4"  # the caller's copy; the preset itself stays
    assert model_rules.load_rules("w8a8-static")[0].weight_qtype == "int8"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('[[rules]]\nweight_qtyp = "int8"\n', "unknown field(s) ['weight_qtyp']"),
        ("[[rules]]\ntile_size = true\n", "rules[0].tile_size must be int"),
        ('[[rules]]\nop_names = "dot_general"\n', "rules[0].op_names must be list"),
        ('qtype = "int8"\n', "unknown top-level key(s) ['qtype']"),
        ("", "no rules"),
        ("[[rules]\n", "not valid TOML"),
    ],
)
def test_bad_rules_files_say_what_to_fix(tmp_path, text, needle):
    path = tmp_path / "rules.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        model_rules.load_rules(str(path))
    assert needle in str(info.value)


def test_unknown_rules_name_the_presets():
    with pytest.raises(ValueError, match=r"neither a preset .*w8a8-static"):
        model_rules.load_rules("w9a9")


def test_batches_split_along_the_first_axis(tmp_path):
    x = np.arange(10 * 3, dtype=np.float32).reshape(10, 3)
    np.save(tmp_path / "x.npy", x)
    batches = list(calibrate.load_batches(tmp_path / "x.npy", 4))
    assert [len(b) for b in batches] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate(batches), x)
    with pytest.raises(ValueError, match="positive"):
        list(calibrate.load_batches(tmp_path / "x.npy", 0))
