"""The model registry: built-ins, entry-point plugins, errors mapped to status codes."""

import dataclasses
from importlib import metadata

import grpc
import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn

from qmill.engine import zoo
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import errors, registry


@dataclasses.dataclass(frozen=True, kw_only=True)
class TinyConfig:
    # Output features.
    features: int = 2


class Tiny(nn.Module):
    config: TinyConfig

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.config.features)(x)


TINY = zoo.ModelEntry(
    name="tiny",
    description="a plugin model",
    config_type=TinyConfig,
    build=Tiny,
    example_input=lambda c, b: jax.ShapeDtypeStruct((b, 3), jnp.float32),
)


class _Dist:
    name = "acme-models"


class _EntryPoint:
    def __init__(self, name, obj):
        self.name, self.value, self.dist, self._obj = name, f"acme:{name}", _Dist(), obj

    def load(self):
        if isinstance(self._obj, Exception):
            raise self._obj
        return self._obj


@pytest.fixture
def plugins(monkeypatch):
    found = [
        _EntryPoint("tiny", TINY),
        _EntryPoint("broken", ImportError("no module acme.broken")),
        _EntryPoint("cnn", TINY),  # may not shadow a built-in
        _EntryPoint("factory", lambda: dataclasses.replace(TINY, name="factory")),
    ]

    def entry_points(*, group):
        assert group == registry.GROUP
        return found

    monkeypatch.setattr(metadata, "entry_points", entry_points)


def test_builtins_and_plugins_are_listed_with_their_origin(plugins):
    infos = {i.name: i for i in registry.model_infos()}
    assert set(infos) == {"cnn", "mlp", "transformer_encoder", "tiny", "factory"}
    assert infos["cnn"].origin == "builtin" and infos["tiny"].origin == "acme-models"
    fields = {f.name: f for f in infos["mlp"].config_fields}
    assert fields["hidden"].type == "list[int]" and fields["hidden"].default_json == "[64, 32]"
    assert fields["in_features"].type == "int"
    assert fields["in_features"].description == "Features of the (flat) input vector."
    # Every built-in field says what it is, for `qmill capabilities` and GetCapabilities.
    assert all(
        f.description for i in infos.values() if i.origin == "builtin" for f in i.config_fields
    )
    # The built-in keeps its name: the plugin's "cnn" was ignored.
    entry, _ = registry.resolve(pb.ModelSpec(name="cnn"))
    assert entry is zoo.BUILTIN["cnn"]


def test_plugin_resolves_and_builds(plugins):
    entry, config = registry.resolve(pb.ModelSpec(name="tiny", config_json='{"features": 5}'))
    assert entry is TINY and config == TinyConfig(features=5)
    assert isinstance(registry.build(pb.ModelSpec(name="factory")), Tiny)


def test_unknown_model_is_not_found_and_lists_the_known_ones():
    with pytest.raises(LookupError) as info:
        registry.resolve(pb.ModelSpec(name="resnet"))
    code, message = errors.status_for(info.value)
    assert code is grpc.StatusCode.NOT_FOUND
    assert "'resnet' not found" in message and "cnn, mlp, transformer_encoder" in message


def test_bad_config_is_invalid_argument():
    with pytest.raises(ValueError) as info:
        registry.resolve(pb.ModelSpec(name="cnn", config_json='{"chanels": [4]}'))
    code, message = errors.status_for(info.value)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown config field(s) ['chanels']" in message and "channels: list[int]" in message
