import pytest

from qmill.client import recipes
from qmill.proto import recipe as recipe_proto


def test_presets_are_valid_recipes_and_copies():
    for name in recipes.PRESETS:
        loaded = recipes.load(name)
        recipe_proto.from_mapping(loaded)
        loaded["rules"].clear()
        assert recipes.load(name)["rules"], "load must not hand out the shared preset"


def test_recipe_file(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text(
        'convention = "torch"\n[[rules]]\npath_regex = ".*"\nqtype = "int4"\n'
        "[rules.tiled_axes]\n1 = 32\n"
    )
    loaded = recipes.load(str(path))
    assert loaded == {
        "convention": "torch",
        "rules": [{"path_regex": ".*", "qtype": "int4", "tiled_axes": {"1": 32}}],
    }
    assert recipe_proto.from_mapping(loaded).rules[0].tiled_axes[1] == 32


def test_bad_recipe_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="neither a preset"):
        recipes.load("int9")
    # A preset in any case is the preset, as a scheme's name is (W4A16 as w4a16) ...
    assert recipes.load("int8") == recipes.PRESETS["int8"]
    assert recipes.load("Nf4") == recipes.load("NF4") == recipes.PRESETS["nf4"]
    assert recipes.load("w4a16") == recipes.load("W4A16")
    # ... but where compressed-tensors names a scheme as qmill names a preset, upper case is
    # the scheme (INT8, W8A8's alias; FP8, static fp8) and mixed case neither.
    assert recipes.load("INT8")["scheme"] == "INT8" and recipes.load("FP8")["scheme"] == "FP8"
    assert recipes.output_format("FP8", None) == "compressed-tensors"
    assert recipes.output_format("fp8", None) is None
    with pytest.raises(ValueError, match="'Fp8' is ambiguous: 'fp8' is qmill's preset"):
        recipes.load("Fp8")
    # A preset one letter off gets a suggestion; nonsense does not.
    with pytest.raises(ValueError, match=r"did you mean int8\?$"):
        recipes.load("int-8")
    with pytest.raises(ValueError, match=r"did you mean nf4\?$"):
        recipes.load("nf5")
    with pytest.raises(ValueError, match=r"nor a file$"):
        recipes.load("gptq-awq")
    bad = tmp_path / "bad.toml"
    bad.write_text("[[rules]\n")
    with pytest.raises(ValueError, match=r"bad\.toml"):
        recipes.load(str(bad))
    unknown = tmp_path / "unknown.toml"
    unknown.write_text('[[rules]]\nqtype = "int8"\nbits = 4\n')
    with pytest.raises(ValueError, match="bits"):
        recipes.load(str(unknown))
