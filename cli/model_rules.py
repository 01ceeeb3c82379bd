"""Model rules for calibration and program export: the named presets and the TOML loader.

Both `qmill calibrate` (calibrate.py) and `qmill export-program` (programs.py) take `--rules`;
the rules live here, below both, so neither imports the other for them.
"""

from __future__ import annotations

import pathlib
import tomllib
from collections.abc import Mapping
from typing import Any

from qmill.proto.v1 import qmill_pb2 as pb

# Named rule sets: int8 (or int4) weights and int8 activations with static (calibrated) scales.
PRESETS: dict[str, tuple[pb.ModelRule, ...]] = {
    "w8a8-static": (pb.ModelRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True),),
    "w4a8-static": (pb.ModelRule(weight_qtype="int4", act_qtype="int8", act_static_scale=True),),
    # The same with one activation scale per tensor for (batch, sequence, features) inputs: what
    # LiteRT stores, so `export-odml` takes a sequence model's calibration (w8a8-static keeps a
    # scale per token there).
    "w8a8-static-seq": (
        pb.ModelRule(
            weight_qtype="int8", act_qtype="int8", act_static_scale=True, act_batch_axes=[0, 1]
        ),
    ),
    # Weight-only, groups of 128 along the input features: what `--method gptq|awq` calibrates.
    "w4-g128": (pb.ModelRule(weight_qtype="int4", tile_size=128),),
    "w3-g128": (pb.ModelRule(weight_qtype="int3", tile_size=128),),
}
# ModelRule's fields and the TOML types they take (a test checks this covers the proto).
RULE_FIELDS: dict[str, type] = {
    "module_path": str,
    "op_names": list,
    "weight_qtype": str,
    "act_qtype": str,
    "tile_size": int,
    "weight_calibration_method": str,
    "act_calibration_method": str,
    "act_static_scale": bool,
    "act_batch_axes": list,
}
# What the items of a list field are.
_ITEMS: dict[str, type] = {"op_names": str, "act_batch_axes": int}


def rules_from_mapping(data: Mapping[str, Any]) -> list[pb.ModelRule]:
    """``{"rules": [{ModelRule fields}, ...]}`` (a parsed TOML file) -> ModelRule messages.

    Raises:
      ValueError: no rules, an unknown key or a value of the wrong type (the message names it).
    """
    valid = ", ".join(f"{k}: {t.__name__}" for k, t in RULE_FIELDS.items())
    if set(data) - {"rules"}:
        raise ValueError(f"unknown top-level key(s) {sorted(set(data) - {'rules'})}; use [[rules]]")
    tables = data.get("rules")
    if not isinstance(tables, list) or not tables:
        raise ValueError("no rules: add one or more [[rules]] tables of " + valid)
    out = []
    for i, table in enumerate(tables):
        if not isinstance(table, dict):
            raise ValueError(f"rules[{i}] must be a table of {valid}")
        unknown = sorted(set(table) - set(RULE_FIELDS))
        if unknown:
            raise ValueError(f"rules[{i}]: unknown field(s) {unknown}; valid: {valid}")
        for key, value in table.items():
            want = RULE_FIELDS[key]
            # bool is an int in Python: keep true/false out of tile_size and vice versa.
            ok = isinstance(value, want) and (want is bool or not isinstance(value, bool))
            if want is list:
                item = _ITEMS[key]
                ok = ok and all(isinstance(v, item) and not isinstance(v, bool) for v in value)
            if not ok:
                raise ValueError(f"rules[{i}].{key} must be {want.__name__}, got {value!r}")
        out.append(pb.ModelRule(**table))
    return out


def load_rules(spec: str) -> list[pb.ModelRule]:
    """A preset name (``w8a8-static``) or a TOML file of ``[[rules]]`` tables."""
    if spec in PRESETS:
        return [pb.ModelRule.FromString(r.SerializeToString()) for r in PRESETS[spec]]  # copies
    path = pathlib.Path(spec)
    if not path.is_file():
        raise ValueError(
            f"rules {spec!r} are neither a preset ({', '.join(PRESETS)}) nor a TOML file"
        )
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML ({exc})") from exc
    try:
        return rules_from_mapping(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
