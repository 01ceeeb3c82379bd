"""Named Flax Linen model builders the server can run for calibration and export.

The modules themselves are in zoo_modules, imported on a model's first build: listing the models
(GetCapabilities) imports no Flax.

A model is named by (registry name, config JSON). Each entry has a frozen config dataclass whose
fields are the JSON keys, a ``build`` giving the unbound module and an ``example_input`` giving
the shape of one input batch. The server's registry adds entry-point plugins to ``BUILTIN``;
plugins declare their config fields with ``config_field(default, description)`` like these.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

if typing.TYPE_CHECKING:
    from flax import linen as nn


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelEntry:
    """One buildable model."""

    # Registry name ("cnn").
    name: str
    # One line for GetCapabilities.
    description: str
    # Frozen kw_only dataclass whose fields are the model's config (JSON keys).
    config_type: type
    # config -> unbound Linen module.
    build: Callable[[Any], nn.Module]
    # (config, batch) -> shape and dtype of one input batch.
    example_input: Callable[[Any, int], jax.ShapeDtypeStruct]


def config_field(default: Any, description: str) -> Any:
    """A config dataclass field with its default and the one line GetCapabilities shows."""
    return dataclasses.field(default=default, metadata={"description": description})


def field_description(field: dataclasses.Field) -> str:
    return field.metadata.get("description", "")


# ------------------------------------------------------------------------------------------ mlp


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlpConfig:
    in_features: int = config_field(64, "Features of the (flat) input vector.")
    hidden: tuple[int, ...] = config_field((64, 32), "Width of each hidden Dense layer, in order.")
    out_features: int = config_field(10, "Outputs (classes).")


# ------------------------------------------------------------------------------------------ cnn


@dataclasses.dataclass(frozen=True, kw_only=True)
class CnnConfig:
    image_size: int = config_field(8, "Input height and width (scikit-learn digits: 8 x 8).")
    in_channels: int = config_field(1, "Input channels.")
    channels: tuple[int, ...] = config_field(
        (16, 32), "Output channels of the two 3x3 convolutions."
    )
    hidden: int = config_field(64, "Width of the hidden Dense layer.")
    num_classes: int = config_field(10, "Classes.")


# -------------------------------------------------------------------------- transformer encoder


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerEncoderConfig:
    seq_len: int = config_field(16, "Tokens per sequence.")
    vocab_size: int = config_field(64, "Vocabulary size of the (integer) token input.")
    d_model: int = config_field(32, "Model width.")
    num_heads: int = config_field(4, "Attention heads; must divide d_model.")
    mlp_dim: int = config_field(64, "Hidden width of each block's MLP.")
    num_layers: int = config_field(2, "Encoder blocks.")
    num_classes: int = config_field(10, "Outputs of the classifier head (mean-pooled tokens).")


def _modules():
    # Flax (with its dependencies ~10-18 MB of a process's memory) on a model's first build, not
    # when the server starts or lists its models.
    from qmill.engine.programs import zoo_modules

    return zoo_modules


def _mlp(c: MlpConfig) -> nn.Module:
    return _modules().Mlp(c)


def _cnn(c: CnnConfig) -> nn.Module:
    return _modules().Cnn(c)


def _check_heads(c: TransformerEncoderConfig) -> nn.Module:
    if c.d_model % c.num_heads:
        raise ValueError(f"num_heads ({c.num_heads}) must divide d_model ({c.d_model})")
    return _modules().TransformerEncoder(c)


_MODULES = ("Mlp", "Cnn", "TransformerEncoder")


def __getattr__(name: str) -> Any:
    """zoo.Mlp, zoo.Cnn, zoo.TransformerEncoder: the modules, imported on first use."""
    if name in _MODULES:
        return getattr(_modules(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


BUILTIN: Mapping[str, ModelEntry] = types.MappingProxyType(
    {
        "mlp": ModelEntry(
            name="mlp",
            description="Dense layers with ReLU on a flattened f32 input (batch, in_features).",
            config_type=MlpConfig,
            build=_mlp,
            example_input=lambda c, b: jax.ShapeDtypeStruct((b, c.in_features), jnp.float32),
        ),
        "cnn": ModelEntry(
            name="cnn",
            description="Two 3x3 convs + two Dense on f32 NHWC images (defaults: sklearn digits).",
            config_type=CnnConfig,
            build=_cnn,
            example_input=lambda c, b: jax.ShapeDtypeStruct(
                (b, c.image_size, c.image_size, c.in_channels), jnp.float32
            ),
        ),
        "transformer_encoder": ModelEntry(
            name="transformer_encoder",
            description="A tiny pre-LN transformer encoder classifier on int32 tokens.",
            config_type=TransformerEncoderConfig,
            build=_check_heads,
            example_input=lambda c, b: jax.ShapeDtypeStruct((b, c.seq_len), jnp.int32),
        ),
    }
)


def field_type_name(tp: Any) -> str:
    """'int', 'float', 'bool', 'str', 'list[int]' ... as GetCapabilities lists them."""
    origin = typing.get_origin(tp)
    if origin in (tuple, list):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return f"list[{field_type_name(args[0]) if args else 'any'}]"
    return getattr(tp, "__name__", str(tp))


def _coerce(name: str, tp: Any, value: Any) -> Any:
    """The JSON value as the field's type; ValueError naming the field and the type."""
    origin = typing.get_origin(tp)
    if origin in (tuple, list):
        (item,) = [a for a in typing.get_args(tp) if a is not Ellipsis] or [Any]
        if not isinstance(value, list):
            raise ValueError(f"config field {name!r} must be a list, got {value!r}")
        return tuple(_coerce(f"{name}[{i}]", item, v) for i, v in enumerate(value))
    # bool is an int in Python: refuse it where a number is meant, and numbers where bool is.
    ok = {
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        bool: lambda v: isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }.get(tp)
    if ok is None:
        return value
    if not ok(value):
        raise ValueError(f"config field {name!r} must be {field_type_name(tp)}, got {value!r}")
    return float(value) if tp is float else value


def config_from_json(entry: ModelEntry, text: str) -> Any:
    """Builds ``entry``'s config from a JSON object (empty text: all defaults).

    Raises:
      ValueError: not a JSON object, an unknown field or a value of the wrong type (the message
        lists the valid fields).
    """
    hints = typing.get_type_hints(entry.config_type)
    fields = {f.name: hints[f.name] for f in dataclasses.fields(entry.config_type)}
    valid = ", ".join(f"{n}: {field_type_name(t)}" for n, t in fields.items())
    try:
        raw = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"model {entry.name!r}: config is not valid JSON ({exc}); fields: {valid}"
        ) from exc
    if not isinstance(raw, dict):
        raise ValueError(f"model {entry.name!r}: config must be a JSON object of {{{valid}}}")
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ValueError(f"model {entry.name!r}: unknown config field(s) {unknown}; valid: {valid}")
    try:
        kwargs = {k: _coerce(k, fields[k], v) for k, v in raw.items()}
        return entry.config_type(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"model {entry.name!r}: {exc}; valid: {valid}") from exc
