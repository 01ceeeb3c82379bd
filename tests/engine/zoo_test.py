"""The model zoo: every built-in builds and runs; configs come from JSON with clear errors."""

import importlib.util
import pathlib

import jax
import numpy as np
import pytest

from qmill.engine import zoo

_spec = importlib.util.spec_from_file_location(
    "qmill_digits_helpers_zoo",
    pathlib.Path(__file__).parent / "providers" / "digits_test.py",
)
digits = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(digits)


@pytest.mark.parametrize("name", sorted(zoo.BUILTIN))
def test_builtin_builds_and_runs_on_its_example_input(name):
    entry = zoo.BUILTIN[name]
    config = zoo.config_from_json(entry, "")
    spec = entry.example_input(config, 3)
    x = np.ones(spec.shape, spec.dtype)
    model = entry.build(config)
    variables = model.init(jax.random.key(0), x)
    out = model.apply(variables, x)
    assert out.shape[0] == 3 and out.ndim == 2
    assert np.all(np.isfinite(np.asarray(out)))


def test_cnn_defaults_are_the_digits_cnn():
    entry = zoo.BUILTIN["cnn"]
    x = np.ones((2, 8, 8, 1), np.float32)
    ours = entry.build(zoo.config_from_json(entry, "{}")).init(jax.random.key(0), x)
    theirs = digits.CNN().init(jax.random.key(0), x)
    assert jax.tree.map(np.shape, ours) == jax.tree.map(np.shape, theirs)
    # Same names and shapes, so the digits CNN's params run in the zoo model unchanged.
    out = entry.build(zoo.CnnConfig()).apply(theirs, x)
    np.testing.assert_array_equal(out, digits.CNN().apply(theirs, x))


def test_config_from_json_sets_fields_with_their_types():
    entry = zoo.BUILTIN["mlp"]
    config = zoo.config_from_json(entry, '{"in_features": 6, "hidden": [8], "out_features": 3}')
    assert config == zoo.MlpConfig(in_features=6, hidden=(8,), out_features=3)
    assert entry.build(config).init(jax.random.key(0), np.ones((1, 6), np.float32))


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"width": 3}', "unknown config field(s) ['width']"),
        ('{"in_features": "8"}', "'in_features' must be int"),
        ('{"in_features": true}', "'in_features' must be int"),
        ('{"hidden": 8}', "'hidden' must be a list"),
        ("[1]", "must be a JSON object"),
        ("{", "not valid JSON"),
    ],
)
def test_bad_config_names_the_valid_fields(text, needle):
    with pytest.raises(ValueError, match="in_features: int") as info:
        zoo.config_from_json(zoo.BUILTIN["mlp"], text)
    assert needle in str(info.value)


def test_transformer_heads_must_divide_width():
    entry = zoo.BUILTIN["transformer_encoder"]
    with pytest.raises(ValueError, match="must divide d_model"):
        entry.build(zoo.config_from_json(entry, '{"d_model": 30, "num_heads": 4}'))
