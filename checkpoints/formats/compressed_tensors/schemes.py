"""compressed-tensors' quantization schemes (llm-compressor's preset names) as qmill recipes.

Each scheme pairs the engine rule that computes compressed-tensors' codes and scales (the same
arithmetic: docs/compressed-tensors.md says where the formats meet and where they part) with the
`config_groups` entry compressed-tensors writes for it. The field values are those
compressed-tensors 0.19 serialises for the preset (its QuantizationArgs, every field present), so
vLLM and transformers read our config as they read llm-compressor's.

A recipe is "of" a scheme when every rule that quantizes carries that scheme's numerics (any
path_regex; skip rules anywhere): a user may widen or narrow the default `ignore` without leaving
the format.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

FORMAT = "compressed-tensors"
# The format of NVFP4, whose global scales ct_global finds before quantizing.
NVFP4 = "nvfp4-pack-quantized"
# The compressed-tensors release whose on-disk layout and config this module writes.
CT_VERSION = "0.19.0"

# Left in the source dtype by default, as users of llm-compressor pass them in `ignore`:
# embeddings, the output head and norms (vectors are never quantized anyway). RE2, full match.
DEFAULT_IGNORE_REGEX = r"(?i).*(embed|lm_head|norm).*"
# compressed-tensors quantizes the `weight` of Linear modules only.
TARGET_REGEX = r".*\.weight"


def _args(**fields: Any) -> dict[str, Any]:
    """One QuantizationArgs as compressed-tensors dumps it (every field, its defaults)."""
    args = {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": None,
        "num_bits": 8,
        "observer": None,
        "observer_kwargs": {},
        "scale_dtype": None,
        "strategy": None,
        "symmetric": True,
        "type": "int",
        "zp_dtype": None,
    }
    unknown = set(fields) - set(args)
    assert not unknown, unknown
    return args | fields


@dataclasses.dataclass(frozen=True)
class Scheme:
    name: str
    # compressed-tensors' compression format ("pack-quantized", "float-quantized", ...).
    format: str
    # The engine rule's numerics (TensorRule fields besides path_regex).
    rule: Mapping[str, Any]
    weights: Mapping[str, Any]
    input_activations: Mapping[str, Any] | None = None

    @property
    def num_bits(self) -> int:
        return int(self.weights["num_bits"])

    @property
    def grouped(self) -> bool:
        """Groups of columns along the input features, of any size (--group-size)."""
        return self.weights.get("strategy") == "group" and "tile_size" in self.rule

    def with_group_size(self, size: int) -> Scheme:
        """The scheme with groups of `size` input features (W4A16's 128 is the preset's)."""
        if not self.grouped:
            raise ValueError(f"{self.name} has no group size to change")
        return dataclasses.replace(
            self,
            rule={**self.rule, "tile_size": size},
            weights={**self.weights, "group_size": size},
        )


# compressed-tensors quantizes with PyTorch: the engine follows its arithmetic (true divisions;
# engine/numerics.py ARITHMETICS), which the reference's differs from for float32/16 weights.
_TORCH = {"arithmetic": "torch"}
_INT_TOKEN = _args(dynamic=True, strategy="token")
_FP8_TOKEN = _args(dynamic=True, strategy="token", type="float")

SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme(
            "W4A16",
            "pack-quantized",
            {"qtype": "int4", "tile_size": 128, **_TORCH},
            _args(num_bits=4, group_size=128, strategy="group"),
        ),
        Scheme(
            "W4A16_ASYM",
            "pack-quantized",
            {"qtype": "int4", "tile_size": 128, "calibration_method": "minmax", **_TORCH},
            _args(
                num_bits=4, group_size=128, strategy="group", symmetric=False, zp_dtype="torch.int8"
            ),
        ),
        Scheme(
            "W8A16",
            "pack-quantized",
            {"qtype": "int8", "tile_size": 128, **_TORCH},
            _args(num_bits=8, group_size=128, strategy="group"),
        ),
        Scheme(
            "W8A8",
            "int-quantized",
            {"qtype": "int8", **_TORCH},
            _args(strategy="channel"),
            _INT_TOKEN,
        ),
        Scheme(
            "FP8_DYNAMIC",
            "float-quantized",
            {"qtype": "float8_e4m3fn", **_TORCH},
            _args(strategy="channel", type="float"),
            _FP8_TOKEN,
        ),
        Scheme(
            "FP8_BLOCK",
            "float-quantized",
            {"qtype": "float8_e4m3fn", "tiled_axes": {0: 128, 1: 128}, **_TORCH},
            _args(strategy="block", type="float", block_structure=[128, 128]),
            _args(dynamic=True, strategy="group", type="float", group_size=128),
        ),
        Scheme(
            "NVFP4A16",
            NVFP4,
            # ct_global adds each tensor's global_scale (rules ahead of this one); the scale
            # dtype is what the engine stores with one, and lets --dry-run count its bytes.
            {"qtype": "nvfp4", "tiled_axes": {1: 16}, "scale_dtype": "float8_e4m3fn", **_TORCH},
            _args(
                num_bits=4,
                group_size=16,
                strategy="tensor_group",
                type="float",
                scale_dtype="torch.float8_e4m3fn",
            ),
        ),
        Scheme(
            "MXFP4A16",
            "mxfp4-pack-quantized",
            {"qtype": "mxfp4", "tiled_axes": {1: 32}, **_TORCH},
            _args(
                num_bits=4, group_size=32, strategy="group", type="float", scale_dtype="torch.uint8"
            ),
        ),
    )
}


# llm-compressor schemes qmill does not write yet, and why (a clear refusal, not "unknown").
NOT_YET: dict[str, str] = {}


def scheme_named(name: str) -> Scheme | None:
    """The scheme called `name`, whatever its case ("w4a16" is W4A16); None if none is.

    Raises:
        ValueError: a scheme qmill does not write yet (NOT_YET), saying why.
    """
    if str(name).upper() in NOT_YET:
        raise ValueError(NOT_YET[str(name).upper()])
    return SCHEMES.get(str(name).upper())


def recipe_for(scheme: Scheme) -> dict[str, Any]:
    """The recipe a scheme preset runs: the default ignore, then the scheme on Linear weights."""
    return {
        "convention": "torch",
        "rules": [
            {"path_regex": DEFAULT_IGNORE_REGEX, "skip": True},
            {"path_regex": TARGET_REGEX, **scheme.rule},
        ],
    }


# TensorRule fields that decide the numerics, with the defaults a mapping may leave out.
_NUMERIC_DEFAULTS: dict[str, Any] = {
    "qtype": None,
    "tile_size": None,
    "tile_if_divisible": False,
    "tiled_axes": None,
    "calibration_method": "absmax",
    "scale_dtype": None,
    "include_vectors": False,
    "contracting_axes": None,
    "channel_axes": None,
    "arithmetic": "",
}


def _numerics(rule: Mapping[str, Any]) -> dict[str, Any]:
    # A tensor's global_scale (ct_global) is its own, not the scheme's: not compared.
    values = {k: rule.get(k, d) for k, d in _NUMERIC_DEFAULTS.items()}
    # A recipe from TOML or a proto may spell these as a table, pairs or lists.
    tiles = values["tiled_axes"]
    if tiles:
        pairs = tiles.items() if isinstance(tiles, Mapping) else tiles
        values["tiled_axes"] = {int(a): int(t) for a, t in pairs}
    else:
        values["tiled_axes"] = None
    for key in ("contracting_axes", "channel_axes"):
        if values[key] is not None:
            values[key] = tuple(values[key]) or None
    return values


def scheme_of_recipe(recipe: Mapping[str, Any]) -> Scheme:
    """The scheme every quantizing rule of `recipe` carries.

    Raises:
        ValueError: no rule quantizes, or one carries numerics no scheme has, or rules carry
            different schemes; the message names the schemes.
    """
    names = ", ".join(SCHEMES)
    found: dict[str, Scheme] = {}  # by label: a scheme and its group size
    for rule in recipe.get("rules", ()):
        if rule.get("skip"):
            continue
        numerics = _numerics(rule)
        match = [_sized(s, numerics) for s in SCHEMES.values() if _matches(s, numerics)]
        if not match:
            raise ValueError(
                f"the recipe rule {rule.get('path_regex', '.*')!r} quantizes in a way no "
                f"compressed-tensors scheme does; pass --recipe with a scheme ({names}), or a "
                "recipe whose quantizing rules are a scheme's (only skip rules added)"
            )
        found[_label(match[0])] = match[0]
    if len(found) != 1:
        what = "no rule quantizes" if not found else f"rules use {', '.join(sorted(found))}"
        raise ValueError(
            f"a compressed-tensors output takes one scheme ({names}); this recipe's {what}"
        )
    return next(iter(found.values()))


def _matches(scheme: Scheme, numerics: Mapping[str, Any]) -> bool:
    """A rule's numerics are the scheme's, a grouped scheme's group size aside."""
    own = _numerics(scheme.rule)
    if scheme.grouped and isinstance(numerics.get("tile_size"), int):
        own["tile_size"] = numerics["tile_size"]
    return own == numerics


def _sized(scheme: Scheme, numerics: Mapping[str, Any]) -> Scheme:
    if scheme.grouped and numerics["tile_size"] != scheme.rule["tile_size"]:
        return scheme.with_group_size(numerics["tile_size"])
    return scheme


def _label(scheme: Scheme) -> str:
    if scheme.grouped and scheme.rule["tile_size"] != SCHEMES[scheme.name].rule["tile_size"]:
        return f"{scheme.name} (groups of {scheme.rule['tile_size']})"
    return scheme.name


def quantization_config(scheme: Scheme, ignore: list[str]) -> dict[str, Any]:
    """config.json's `quantization_config` for weights in `scheme`, `ignore` left as they were.

    The fields and values are compressed-tensors' (QuantizationConfig.model_dump plus the
    method, version and transform fields model_free_ptq adds); nothing of qmill's, since
    compressed-tensors refuses fields it does not know inside a group.
    """
    group = {
        "format": scheme.format,
        "input_activations": dict(scheme.input_activations) if scheme.input_activations else None,
        "output_activations": None,
        "targets": ["Linear"],
        "weights": dict(scheme.weights),
    }
    return {
        "config_groups": {scheme.name: group},
        "format": scheme.format,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "quant_method": FORMAT,
        "quantization_status": "compressed",
        "transform_config": {},
        "version": CT_VERSION,
    }
