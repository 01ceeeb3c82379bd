import pytest

from qmill.engine.modelfree import recipes


def test_bad_regex_is_reported_with_the_rule_index():
    with pytest.raises(ValueError, match=r"recipe rule 1: .*'\(' is not a valid regex"):
        recipes.recipe_from_mapping(
            {"rules": [{"qtype": "int8"}, {"path_regex": "(", "qtype": "int8"}]}
        )


def test_rule_needs_a_qtype_or_skip():
    with pytest.raises(ValueError, match="needs a qtype"):
        recipes.recipe_from_mapping({"rules": [{"path_regex": ".*"}]})


def test_layout_override_needs_both_axis_lists():
    with pytest.raises(ValueError, match="both contracting_axes and channel_axes"):
        recipes.recipe_from_mapping({"rules": [{"qtype": "int8", "contracting_axes": [0]}]})


def test_empty_recipe_and_unknown_fields():
    with pytest.raises(ValueError, match="at least one rule"):
        recipes.recipe_from_mapping({"rules": []})
    with pytest.raises(ValueError, match="unknown rule field"):
        recipes.recipe_from_mapping({"rules": [{"qtype": "int8", "bits": 3}]})
    with pytest.raises(ValueError, match="convention 'jax'"):
        recipes.recipe_from_mapping({"convention": "jax", "rules": [{"qtype": "int8"}]})


def test_nonpositive_tile():
    with pytest.raises(ValueError, match="tile_size must be positive"):
        recipes.recipe_from_mapping({"rules": [{"qtype": "int8", "tile_size": -4}]})


@pytest.mark.parametrize("name", ["int8", "uint4", "bool", "complex64", "no_such_dtype"])
def test_a_scale_dtype_that_is_not_floating_is_refused_with_the_fix(name: str) -> None:
    with pytest.raises(ValueError, match=f"scale_dtype must be a floating dtype.*{name}"):
        recipes.TensorRule(qtype="int8", scale_dtype=name)


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_floating_scale_dtypes_are_accepted(name: str) -> None:
    assert recipes.TensorRule(qtype="int8", scale_dtype=name).scale_dtype == name


def test_an_unknown_qtype_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"recipe rule 0: .*'int99' is not a qtype.*int8"):
        recipes.recipe_from_mapping({"rules": [{"qtype": "int99"}]})


def test_path_regexes_match_in_linear_time_so_a_catastrophic_pattern_cannot_stall():
    # `(a+)+$` backtracks exponentially in Python's re: 2^29 steps for 29 a's and a '!'. RE2
    # answers at once; with Python's engine this test would not finish within pytest's timeout.
    rule = recipes.recipe_from_mapping({"rules": [{"path_regex": "(a+)+$", "qtype": "int8"}]})
    assert not rule.rules[0].matches("a" * 40 + "!")
    assert not rule.rules[0].matches("a" * 100_000 + "!")
    assert rule.rules[0].matches("aaaa")


@pytest.mark.parametrize("pattern", [r"(a)\1", r"(?=kernel).*", r".*(?<!bias)", r"(?!x).*"])
def test_backtracking_constructs_are_refused_at_recipe_load_with_the_fix(pattern):
    with pytest.raises(ValueError, match=r"not a valid regex.*backreferences.*lookahead"):
        recipes.recipe_from_mapping({"rules": [{"path_regex": pattern, "qtype": "int8"}]})


@pytest.mark.parametrize("pattern", [r"((((a{100}){100}){100}){100})", r"a{1001}"])
def test_a_repetition_over_re2s_limit_gets_advice_about_counts_not_backreferences(pattern):
    # Issue 39: RE2's "invalid repetition size" went on about backreferences.
    with pytest.raises(ValueError) as e:
        recipes.recipe_from_mapping({"rules": [{"path_regex": pattern, "qtype": "int8"}]})
    message = str(e.value)
    assert "invalid repetition size" in message and "at most 1000" in message
    assert "nested ones multiplied" in message and "backreference" not in message


@pytest.mark.parametrize("pattern", ["(", r"a**", r"\q"])
def test_a_plain_syntax_error_is_not_blamed_on_backreferences(pattern):
    with pytest.raises(ValueError) as e:
        recipes.recipe_from_mapping({"rules": [{"path_regex": pattern, "qtype": "int8"}]})
    assert "fix what RE2 names" in str(e.value) and "rewrite the pattern" not in str(e.value)


def test_python_regex_features_people_use_still_work():
    recipe = recipes.recipe_from_mapping(
        {"rules": [{"path_regex": r"(?i).*(?P<layer>dense_\d+)/KERNEL", "qtype": "int8"}]}
    )
    assert recipe.rules[0].matches("params/Dense_12/kernel")


def test_a_meaningless_calibration_factor_is_refused_when_the_recipe_arrives():
    for method in ("absmax,0", "fixed,-inf,inf", "rms,nan"):
        with pytest.raises(ValueError, match=r"recipe rule 0: rule '\.\*': calibration method"):
            recipes.recipe_from_mapping(
                {"rules": [{"path_regex": ".*", "qtype": "int8", "calibration_method": method}]}
            )
