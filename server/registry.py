"""The model registry: the engine zoo's built-ins plus entry-point plugins (group qmill.models).

A platform team ships its own architectures in its image by installing a distribution with an
entry point ``[project.entry-points."qmill.models"] name = "pkg.module:ENTRY"``, where ENTRY is a
``zoo.ModelEntry`` (or a callable returning one). Plugins cannot replace a built-in name: a
registry whose meaning depends on install order would make results irreproducible.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import typing
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from qmill.engine.programs import zoo
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import errors

log = logging.getLogger(__name__)

GROUP = "qmill.models"
BUILTIN_ORIGIN = "builtin"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Registered:
    entry: zoo.ModelEntry
    # "builtin" or the plugin's distribution name.
    origin: str


def _load_plugin(ep: metadata.EntryPoint) -> zoo.ModelEntry:
    obj = ep.load()
    if not isinstance(obj, zoo.ModelEntry) and callable(obj):
        obj = obj()
    if not isinstance(obj, zoo.ModelEntry):
        raise TypeError(f"entry point {ep.name!r} gave {type(obj).__name__}, not a ModelEntry")
    return obj


def registry() -> dict[str, Registered]:
    """Built-ins, then every loadable plugin (a broken plugin is logged and skipped)."""
    out = {name: Registered(entry=e, origin=BUILTIN_ORIGIN) for name, e in zoo.BUILTIN.items()}
    for ep in metadata.entry_points(group=GROUP):
        if ep.name in out:
            log.warning("model plugin %r ignored: the name is taken (%s)", ep.name, out[ep.name])
            continue
        try:
            entry = _load_plugin(ep)
        except Exception:  # a plugin's bug must not take the server down
            log.exception("model plugin %r could not be loaded", ep.name)
            continue
        dist = getattr(ep, "dist", None)
        out[ep.name] = Registered(entry=entry, origin=dist.name if dist else ep.value)
    return out


def resolve(
    spec: pb.ModelSpec, models: Mapping[str, Registered] | None = None
) -> tuple[zoo.ModelEntry, Any]:
    """(entry, config) for a ModelSpec.

    Raises:
      errors.NotFound: unknown name (NOT_FOUND; the message lists the known ones).
      ValueError: a bad config (INVALID_ARGUMENT; the message lists the fields).
    """
    models = registry() if models is None else models
    if not spec.name:
        raise ValueError(f"model name is empty; known models: {', '.join(sorted(models))}")
    found = models.get(spec.name)
    if found is None:
        raise errors.NotFound(
            f"model {spec.name!r} not found; known models: {', '.join(sorted(models))}"
        )
    return found.entry, zoo.config_from_json(found.entry, spec.config_json)


def build(spec: pb.ModelSpec) -> Any:
    """The unbound Linen module a ModelSpec names (the ODML exporter's Backends.resolve_model)."""
    entry, config = resolve(spec)
    return entry.build(config)


def _default_json(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return ""
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def model_infos(models: Mapping[str, Registered] | None = None) -> list[pb.ModelInfo]:
    """ModelInfo messages for GetCapabilities, sorted by name."""
    models = registry() if models is None else models
    out = []
    for name in sorted(models):
        reg = models[name]
        hints = typing.get_type_hints(reg.entry.config_type)
        fields = [
            pb.ModelConfigField(
                name=f.name,
                type=zoo.field_type_name(hints[f.name]),
                default_json=_default_json(f),
                description=zoo.field_description(f),
            )
            for f in dataclasses.fields(reg.entry.config_type)
        ]
        out.append(
            pb.ModelInfo(
                name=name,
                description=reg.entry.description,
                config_fields=fields,
                origin=reg.origin,
            )
        )
    return out
