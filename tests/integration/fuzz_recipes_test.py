"""Hypothesis-generated recipes, as mappings and as TOML files, against a real server.

fuzz_test.py breaks the wire one defect at a time; here the recipe is random as a whole: random
rules with random regexes, qtypes, tiles, tiled axes, layouts, scale dtypes and calibration
methods (valid or not, numbers included: nan, inf, 0, negative, huge), and TOML files written
from such mappings or with bytes cut and swapped. Each one quantizes the same two tensors (a
kernel and a vector). It must end one of two ways: refused as the user's error (ValueError on the
client before sending, or INVALID_ARGUMENT / OUT_OF_RANGE / RESOURCE_EXHAUSTED from the server,
with a message) or answered with one outcome per tensor whose scales are finite and positive.
Never INTERNAL, UNKNOWN or a traceback, and the server answers health checks afterwards. 2,000
recipes in all, derandomized so CI runs the same ones and a failure reproduces.

The numbers drawn are few on purpose: every distinct (qtype, tiles, method, scale dtype) is a
jit compile on the server, and a handful of values per field still reaches every code path.
"""

from __future__ import annotations

import collections
import json
import math

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from qmill.client import Client, errors, recipes
from qmill.engine import qtypes
from tests.integration import fuzzing

# Client errors the server may answer a recipe with; anything else fails the test.
ALLOWED = {"INVALID_ARGUMENT", "OUT_OF_RANGE", "RESOURCE_EXHAUSTED"}
rng = np.random.default_rng(0)
TENSORS = [
    ("layer_0/attn/kernel", rng.normal(size=(16, 32)).astype(np.float32)),
    ("layer_0/attn/bias", rng.normal(size=(32,)).astype(np.float32)),
]
PATHS = [path for path, _ in TENSORS]


def _settings(n: int):
    return fuzzing.derandomized(n, HealthCheck.data_too_large)


class Target:
    def __init__(self, address: str) -> None:
        self.client = Client(address, timeout=60)
        self.channel = grpc.insecure_channel(address)
        self.results: collections.Counter[str] = collections.Counter()

    def quantize(self, recipe) -> None:
        """Sends `recipe` with TENSORS; asserts it is refused cleanly or answered soundly."""
        try:
            outcomes = list(self.client.quantize(recipe, TENSORS))
        except errors.QmillError as e:
            assert e.code in ALLOWED, (e.code, e.details, recipe)
            assert e.details and "internal error" not in e.details, (e.code, recipe)
            self.results[e.code] += 1
            return
        except ValueError as e:  # refused by the client before anything was sent
            assert str(e), recipe
            self.results["client ValueError"] += 1
            return
        assert [o.path for o in outcomes] == PATHS, recipe
        for outcome in outcomes:
            if outcome.quantized:
                scale = np.asarray(outcome.parts["scale"], np.float32)
                assert np.isfinite(scale).all() and (scale > 0).all(), (outcome.path, recipe)
            else:
                assert outcome.reason, (outcome.path, recipe)
        self.results["answered"] += 1


@pytest.fixture(scope="module")
def target(make_server):
    running = make_server()
    t = Target(running.address)
    yield t
    health = health_pb2_grpc.HealthStub(t.channel).Check(
        health_pb2.HealthCheckRequest(), timeout=30
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    (outcome,) = t.client.quantize("int8", [TENSORS[0]])
    assert outcome.quantized
    assert running.server.limiter.used == 0
    print(f"fuzz: {sum(t.results.values())} recipes: {dict(t.results)}")
    t.client.close()
    t.channel.close()


# Regexes from pieces that match the paths above, RE2 syntax it refuses (backreferences,
# lookaround) and unbalanced ones, joined at random.
REGEX_PIECES = [
    "layer",
    "_0",
    "/",
    ".*",
    "attn",
    "kernel|bias",
    "(a+)+",
    "[a-z]+",
    "\\d",
    "$",
    "^",
    "(?=x)",
    "(a)\\1",
    "(",
    ")",
    "[",
    "embed",
    "{2,3}",
    "?",
    "\\",
    "é",
    "",
]
NUMBERS = ["0", "-1", "6", "-6", "1e400", "nan", "x", ""]
CALIBRATION = st.one_of(
    st.sampled_from(["absmax", "minmax", "rms,3", "fixed,-6,6", "ABSMAX", "rms", "", "nope"]),
    st.tuples(
        st.sampled_from(["absmax", "minmax", "rms", "fixed"]),
        st.lists(st.sampled_from(NUMBERS), max_size=3),
    ).map(lambda t: ",".join([t[0], *t[1]])),
)
# Every qtype can be drawn, the usual ones far more often (each valid draw is a compile).
COMMON = ["int8", "int4", "nf4", "float8_e4m3fn", "mxfp4"]
QTYPE = st.one_of(
    st.sampled_from(COMMON),
    st.sampled_from(["int9", "", "INT8", "fp8", "float8"]),
    st.sampled_from(qtypes.names()),
)
TILE = st.sampled_from([0, 3, 8, -1, 2**40])
AXIS = st.sampled_from([-1, 0, 1, 5])
RULE_FIELDS = {
    "path_regex": st.lists(st.sampled_from(REGEX_PIECES), max_size=4).map("".join),
    "qtype": QTYPE,
    "tile_size": TILE,
    "tile_if_divisible": st.booleans(),
    "tiled_axes": st.dictionaries(AXIS, TILE, max_size=2),
    "calibration_method": CALIBRATION,
    "contracting_axes": st.lists(AXIS, max_size=2),
    "channel_axes": st.lists(AXIS, max_size=2),
    "skip": st.booleans(),
    "include_vectors": st.booleans(),
    "scale_dtype": st.sampled_from(["float16", "int8", "float33", ""]),
}


@st.composite
def rules(draw):
    names = draw(st.sets(st.sampled_from(sorted(RULE_FIELDS)), max_size=5))
    rule = {name: draw(RULE_FIELDS[name]) for name in sorted(names)}
    if draw(st.booleans()):  # most rules name a qtype, as real ones do
        rule["qtype"] = draw(st.sampled_from(COMMON))
    return rule


RECIPES = st.fixed_dictionaries(
    {"rules": st.lists(rules(), max_size=3)},
    optional={"convention": st.sampled_from(["auto", "flax", "torch", "jax", ""])},
)


@given(recipe=RECIPES)
def _mapping_recipes(target, recipe):
    target.quantize(recipe)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value) if math.isfinite(value) else str(value).replace("infinity", "inf")
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string; surrogates make it malformed, fine
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return "{" + ", ".join(f'"{k}" = {_toml_value(v)}' for k, v in value.items()) + "}"


def _toml(recipe: dict) -> str:
    lines = [f"convention = {_toml_value(recipe['convention'])}"] if "convention" in recipe else []
    for rule in recipe["rules"]:
        lines.append("[[rules]]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in rule.items()]
    return "\n".join(lines) + "\n"


# Values of the wrong TOML type for any field, and keys that do not exist.
WRONG = st.sampled_from([1.5, -3, True, "x", [1, "a"], {"a": 1}, [], {}, 2**62])
# Mostly broken files: what the mapping cases already cover is a file written as it should be.
EDITS = st.sampled_from(
    ["none", "wrong_type", "wrong_type", "unknown_key", "rules_not_a_list", "cut", "cut", "swap"]
)


@given(recipe=RECIPES, edit=EDITS, data=st.data())
def _toml_recipes(target, tmp_path_factory, recipe, edit, data):
    if edit == "wrong_type" and recipe["rules"]:
        key = data.draw(st.sampled_from(sorted(RULE_FIELDS)))
        recipe["rules"][0][key] = data.draw(WRONG)
    elif edit == "unknown_key":
        recipe[data.draw(st.sampled_from(["rule", "extra", "version"]))] = data.draw(WRONG)
    text = _toml(recipe)
    if edit == "rules_not_a_list":
        text = f"rules = {_toml_value(data.draw(WRONG))}\n"
    elif edit == "cut":
        text = text[: data.draw(st.integers(0, len(text)))]
    elif edit == "swap" and len(text) > 1:
        i = data.draw(st.integers(0, len(text) - 2))
        text = text[:i] + text[i + 1] + text[i] + text[i + 2 :]
    path = tmp_path_factory.getbasetemp() / "fuzz-recipe.toml"
    path.write_text(text, errors="surrogatepass")
    try:
        loaded = recipes.load(path)
    except ValueError as e:  # a file the client refuses: one line, no other exception type
        assert str(e), text
        target.results["client ValueError"] += 1
        return
    target.quantize(loaded)


@pytest.mark.parametrize(
    ("case", "examples"),
    [(_mapping_recipes, 800), (_toml_recipes, 1200)],
    ids=["mapping", "toml"],
)
def test_random_recipes_are_refused_cleanly_or_quantize_soundly(
    target, tmp_path_factory, case, examples
):
    before = sum(target.results.values())
    if case is _toml_recipes:
        _settings(examples)(case)(target, tmp_path_factory)
    else:
        _settings(examples)(case)(target)
    assert sum(target.results.values()) - before >= examples


@pytest.mark.parametrize(
    "text", ["rules = 1.5", "rules = [1]", 'rules = "int8"', "convention = [1]"]
)
def test_recipe_files_of_the_wrong_shape_are_the_users_error(tmp_path, text):
    # Found by the TOML fuzz: these raised TypeError (a traceback from the CLI).
    path = tmp_path / "recipe.toml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError, match=r"rules must be a list of tables|convention"):
        recipes.load(path)
