"""Recipe messages <-> plain mappings, the form recipe files and the engine use.

The mapping is {"convention": "auto"|"flax"|"torch", "rules": [{field: value}, ...]} with the
field names of the Rule message, and "scheme" (a compressed-tensors preset's name) when set.
Unset fields are left out, so the engine's defaults apply.
Checking values (regexes, qtypes, tiles) is the engine's job; this module only moves them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qmill.proto.v1 import qmill_pb2 as pb

_CONVENTIONS = {
    "auto": pb.CONVENTION_UNSPECIFIED,
    "flax": pb.CONVENTION_FLAX,
    "torch": pb.CONVENTION_TORCH,
}
_SCALARS = (
    "path_regex",
    "qtype",
    "tile_size",
    "tile_if_divisible",
    "calibration_method",
    "skip",
    "include_vectors",
    "scale_dtype",
    "arithmetic",
    "global_scale",
)
_LAYOUT = ("contracting_axes", "channel_axes")
RULE_FIELDS = (*_SCALARS, "tiled_axes", *_LAYOUT)


def to_mapping(message: pb.Recipe) -> dict[str, Any]:
    rules = []
    for r in message.rules:
        rule: dict[str, Any] = {k: getattr(r, k) for k in _SCALARS if getattr(r, k)}
        if r.tiled_axes:
            rule["tiled_axes"] = dict(r.tiled_axes)
        if r.override_layout:
            rule.update({k: list(getattr(r, k)) for k in _LAYOUT})
        rules.append(rule)
    names = {v: k for k, v in _CONVENTIONS.items()}
    if message.convention not in names:
        raise ValueError(f"unknown convention value {message.convention}")
    scheme = {"scheme": message.scheme} if message.scheme else {}
    return {"convention": names[message.convention], "rules": rules, **scheme}


def from_mapping(fields: Mapping[str, Any]) -> pb.Recipe:
    """Raises ValueError for unknown keys or values of the wrong type, naming them."""
    unknown = sorted(set(fields) - {"rules", "convention", "scheme"})
    if unknown:
        raise ValueError(
            f"unknown recipe key(s) {unknown}; valid: ['convention', 'rules', 'scheme']"
        )
    convention = fields.get("convention", "auto")
    if not isinstance(convention, str) or convention not in _CONVENTIONS:
        raise ValueError(f"convention {convention!r} is not one of {sorted(_CONVENTIONS)}")
    scheme = fields.get("scheme") or ""
    if not isinstance(scheme, str):
        raise ValueError(f"scheme {scheme!r} must be a scheme's name (a string)")
    message = pb.Recipe(convention=_CONVENTIONS[convention], scheme=scheme)
    rules = fields.get("rules") or ()
    # A TOML file says `rules = 1.5` as easily as [[rules]]: refuse it as the user's mistake.
    if not isinstance(rules, list | tuple) or not all(isinstance(r, Mapping) for r in rules):
        raise ValueError(f"rules must be a list of tables ([[rules]] in TOML), got {rules!r}")
    for index, rule in enumerate(rules):
        unknown = sorted(set(rule) - set(RULE_FIELDS))
        if unknown:
            raise ValueError(
                f"rule {index}: unknown field(s) {unknown}; valid: {list(RULE_FIELDS)}"
            )
        try:
            r = message.rules.add(**{k: v for k, v in rule.items() if k in _SCALARS})
            for axis, tile in dict(rule.get("tiled_axes") or {}).items():
                r.tiled_axes[int(axis)] = int(tile)
            if any(k in rule for k in _LAYOUT):
                r.override_layout = True
                for key in _LAYOUT:
                    getattr(r, key).extend(int(a) for a in rule.get(key) or ())
        except (TypeError, ValueError) as e:
            raise ValueError(f"rule {index}: {e}") from None
    return message
