"""Recipes on the client: the built-in presets and recipe files (TOML), as plain mappings.

A recipe file looks like this; rules are tried in order and the first full match wins:

    convention = "flax"          # optional: "auto" (by name), "flax" or "torch"

    [[rules]]
    path_regex = ".*embedding"   # keep embeddings in float
    skip = true

    [[rules]]
    path_regex = ".*"
    qtype = "int4"
    tile_size = 128
    calibration_method = "absmax"

Rule fields: path_regex, qtype, tile_size, tile_if_divisible, tiled_axes (table axis = tile),
calibration_method, contracting_axes, channel_axes, skip, include_vectors, scale_dtype.
"""

from __future__ import annotations

import copy
import difflib
import os
import pathlib
import tomllib
from collections.abc import Mapping
from typing import Any

from qmill.checkpoints import ct_schemes
from qmill.proto import recipe as recipe_proto
from qmill.proto.v1 import qmill_pb2 as pb

PRESETS: dict[str, dict[str, Any]] = {
    "int8": {"rules": [{"path_regex": ".*", "qtype": "int8"}]},
    # Sub-channel blocks of 128 where the contracting axis allows it, per channel elsewhere.
    "int4": {
        "rules": [
            {"path_regex": ".*", "qtype": "int4", "tile_size": 128, "tile_if_divisible": True}
        ]
    },
    "fp8": {"rules": [{"path_regex": ".*", "qtype": "float8_e4m3fn"}]},
    "nf4": {
        "rules": [{"path_regex": ".*", "qtype": "nf4", "tile_size": 64, "tile_if_divisible": True}]
    },
}


def scheme_of_name(spec: Recipe) -> ct_schemes.Scheme | None:
    """The compressed-tensors scheme a recipe name means, or None (a preset of qmill's, a file,
    a mapping). Names are any case, but qmill's presets keep theirs: `int8` and `fp8` are
    qmill's, `INT8` and `FP8` compressed-tensors' (W8A8's alias; static fp8).

    Raises:
      ValueError: a name both could mean in mixed case ("Fp8").
    """
    if not isinstance(spec, str):
        return None
    scheme = ct_schemes.scheme_named(spec)
    if scheme is None or spec.lower() not in PRESETS or spec == spec.upper():
        return scheme
    if spec == spec.lower():
        return None
    raise ValueError(
        f"recipe {spec!r} is ambiguous: {spec.lower()!r} is qmill's preset, {spec.upper()!r} "
        "compressed-tensors' scheme"
    )


def output_format(spec: Recipe, output_format: str | None) -> str | None:
    """The output format a recipe implies when none is asked for: a compressed-tensors scheme's
    name (W4A16, ...) means a compressed-tensors output."""
    if output_format is None and scheme_of_name(spec) is not None:
        return ct_schemes.FORMAT
    return output_format


# What every call that takes a recipe accepts: a preset name, a TOML file's path or a mapping.
Recipe = str | os.PathLike[str] | Mapping[str, Any]


def load(spec: Recipe) -> dict[str, Any]:
    """A preset name, the path of a TOML recipe file or a mapping, as a mapping (a copy).

    Raises:
      ValueError: neither a preset nor a readable, well-formed recipe file.
    """
    if isinstance(spec, Mapping):
        return copy.deepcopy(dict(spec))
    if (scheme := scheme_of_name(spec)) is not None:
        return ct_schemes.recipe_for(scheme)
    if isinstance(spec, str) and spec.lower() in PRESETS:  # any case, as the schemes' names
        return copy.deepcopy(PRESETS[spec.lower()])
    path = pathlib.Path(spec)
    if not path.is_file():
        close = difflib.get_close_matches(str(spec).lower(), PRESETS, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ValueError(
            f"recipe {spec!r} is neither a preset ({', '.join(PRESETS)}), a compressed-tensors "
            f"scheme ({', '.join(ct_schemes.SCHEMES)}) nor a file{hint}"
        )
    try:
        fields = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"recipe file {spec}: {e}") from None
    recipe_proto.from_mapping(fields)  # checks the keys now rather than at the server
    return fields


def with_group_size(recipe: Mapping[str, Any], size: int) -> dict[str, Any]:
    """The recipe with groups of `size` input features in every quantizing rule (--group-size).

    Raises:
      ValueError: a size below 1, or a rule whose tiling is fixed by its qtype or blocks
        (NVFP4's 16, MXFP4's 32, FP8_BLOCK's 128 × 128).
    """
    if size < 1:
        raise ValueError(f"--group-size must be at least 1, got {size}")
    out = copy.deepcopy(dict(recipe))
    for rule in out.get("rules", ()):
        if rule.get("skip"):
            continue
        if rule.get("tiled_axes"):
            raise ValueError(
                f"--group-size does not apply to the rule {rule.get('path_regex', '.*')!r}: its "
                f"tiling {rule['tiled_axes']} is fixed (group schemes: W4A16, W4A16_ASYM, "
                "W8A16; presets int4, nf4, int8)"
            )
        rule["tile_size"] = size
    return out


def message(spec: Recipe) -> pb.Recipe:
    """The Recipe message of a preset name, a TOML recipe file or a mapping.

    Raises:
      ValueError: not a preset or a recipe file, or a recipe with unknown keys or bad values.
    """
    return recipe_proto.from_mapping(spec if isinstance(spec, Mapping) else load(spec))
