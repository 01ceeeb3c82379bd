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
# MXFP8's: float8_e4m3fn codes as they are, E8M0 (uint8) scales per group of 32.
MXFP8 = "mxfp8-quantized"
# The compressed-tensors release whose on-disk layout and config this module writes.
CT_VERSION = "0.19.0"

# Left in the source dtype by default, as users of llm-compressor pass them in `ignore`:
# embeddings, the output head and norms (vectors are never quantized anyway). RE2, full match.
DEFAULT_IGNORE_REGEX = r"(?i).*(embed|lm_head|norm).*"
# A mixture of experts' routers (Mixtral's block_sparse_moe.gate, Qwen's mlp.gate and Qwen2-MoE's
# shared_expert_gate) stay in the source dtype too: llm-compressor's users ignore them, and
# transformers 5 loads them as plain parameters, not quantized Linears.
ROUTER_IGNORE_REGEX = r".*\.(block_sparse_moe\.gate|mlp\.gate|mlp\.shared_expert_gate)\.weight"
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

    @property
    def static_inputs(self) -> bool:
        """Whether each Linear's input has a calibrated scale (FP8's input_scale, NVFP4's
        input_global_scale): the scheme needs calibration data, and llm-compressor's `oneshot`
        (not model_free_ptq) writes it."""
        inputs = self.input_activations
        return inputs is not None and inputs.get("dynamic") is not True

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
# MX formats: groups of 32 with E8M0 (uint8) scales, for weights and dynamic activations alike.
_MX = {"group_size": 32, "strategy": "group", "type": "float", "scale_dtype": "torch.uint8"}
_NVFP4_RULE = {"qtype": "nvfp4", "tiled_axes": {1: 16}, "scale_dtype": "float8_e4m3fn", **_TORCH}
_NVFP4_ARGS = {
    "num_bits": 4,
    "group_size": 16,
    "strategy": "tensor_group",
    "type": "float",
    "scale_dtype": "torch.float8_e4m3fn",
}
# What llm-compressor's oneshot records of the observers it ran (the static schemes' configs).
_WEIGHT_OBSERVER = {"observer": "memoryless_minmax"}
_STATIC_OBSERVER = {"observer": "static_minmax"}


def _int_group(bits: int) -> dict[str, Any]:
    """The WnAm family's weights: symmetric int`bits`, groups of 128 input features."""
    return {"qtype": f"int{bits}", "tile_size": 128, **_TORCH}


def _wnam(bits: int, act_bits: int) -> Scheme:
    """compressed-tensors' integer WnAm preset: n-bit weights in groups of 128; with m < 16 the
    activations are m-bit integers per token, dynamic, and the codes are stored one per int8
    (`int-quantized`), else packed into int32 words (`pack-quantized`)."""
    weights = _args(num_bits=bits, group_size=128, strategy="group")
    if act_bits == 16:
        return Scheme(f"W{bits}A16", "pack-quantized", _int_group(bits), weights)
    inputs = _args(num_bits=act_bits, dynamic=True, strategy="token")
    return Scheme(f"W{bits}A{act_bits}", "int-quantized", _int_group(bits), weights, inputs)


def _mx(bits: int, *, dynamic: bool) -> Scheme:
    """MXFP4 / MXFP8 (dynamic: their activations too, in groups of 32 at run time) and their
    weight-only A16 forms."""
    qtype, fmt = {4: ("mxfp4", "mxfp4-pack-quantized"), 8: ("mxfp8", MXFP8)}[bits]
    inputs = _args(num_bits=bits, dynamic=True, **_MX) if dynamic else None
    rule = {"qtype": qtype, "tiled_axes": {1: 32}, **_TORCH}
    name = f"MXFP{bits}" + ("" if dynamic else "A16")
    return Scheme(name, fmt, rule, _args(num_bits=bits, **_MX), inputs)


_W8A8 = Scheme(
    "W8A8", "int-quantized", {"qtype": "int8", **_TORCH}, _args(strategy="channel"), _INT_TOKEN
)

# In this order: a recipe that does not name its scheme (an older one, or a file) is the first
# whose numerics its rules carry, so W4A16 before W4A8 and W8A8 before its alias INT8.
SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        _wnam(4, 16),
        Scheme(
            "W4A16_ASYM",
            "pack-quantized",
            {**_int_group(4), "calibration_method": "minmax"},
            _args(
                num_bits=4, group_size=128, strategy="group", symmetric=False, zp_dtype="torch.int8"
            ),
        ),
        _wnam(8, 16),
        _W8A8,
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
        # ct_global adds each tensor's global_scale (rules ahead of this one); the scale dtype
        # is what the engine stores with one, and lets --dry-run count its bytes.
        Scheme("NVFP4A16", NVFP4, _NVFP4_RULE, _args(**_NVFP4_ARGS)),
        _mx(4, dynamic=False),
        dataclasses.replace(_W8A8, name="INT8"),
        *(_wnam(bits, 16) for bits in (2, 3, 5, 6, 7)),
        # W8A8 is not of the family: per channel, above.
        *(_wnam(bits, 4) for bits in (2, 3, 4)),
        *(_wnam(bits, 8) for bits in range(2, 8)),
        Scheme("W4AFP8", "int-quantized", _int_group(4), _wnam(4, 16).weights, _FP8_TOKEN),
        _mx(4, dynamic=True),
        _mx(8, dynamic=False),
        _mx(8, dynamic=True),
        # Static activations (calibrated: checkpoints/ct_activations.py). FP8: one weight scale
        # per tensor (no channel axis) and one input scale per Linear.
        Scheme(
            "FP8",
            "float-quantized",
            {"qtype": "float8_e4m3fn", "contracting_axes": [1], "channel_axes": [], **_TORCH},
            _args(strategy="tensor", type="float", **_WEIGHT_OBSERVER),
            _args(strategy="tensor", type="float", **_STATIC_OBSERVER),
        ),
        Scheme(
            "NVFP4",
            NVFP4,
            _NVFP4_RULE,
            _args(**_NVFP4_ARGS, **_WEIGHT_OBSERVER),
            # Group scales found at run time ("local"), the global scale calibrated.
            _args(**_NVFP4_ARGS, dynamic="local", **_STATIC_OBSERVER),
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
    """The recipe a scheme preset runs: the default ignore, then the scheme on Linear weights.
    It names its scheme: several share their weights' numerics (W4A16, W4A8, W4AFP8, ...)."""
    return {
        "scheme": scheme.name,
        "convention": "torch",
        "rules": [
            {"path_regex": DEFAULT_IGNORE_REGEX, "skip": True},
            {"path_regex": ROUTER_IGNORE_REGEX, "skip": True},
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
            values[key] = tuple(values[key])  # () channel axes: one scale per tensor (FP8)
    return values


def scheme_of_recipe(recipe: Mapping[str, Any]) -> Scheme:
    """The scheme every quantizing rule of `recipe` carries: the one its `scheme` names, else
    the first of SCHEMES whose numerics the rules carry.

    Raises:
        ValueError: no rule quantizes, or one carries numerics no scheme has (or not the named
            scheme's), or rules carry different schemes, or the named scheme is unknown; the
            message names the schemes.
    """
    names = ", ".join(SCHEMES)
    named = recipe.get("scheme")
    candidates = list(SCHEMES.values())
    if named:
        scheme = scheme_named(str(named))
        if scheme is None:
            raise ValueError(f"the recipe's scheme {named!r} is none of {names}")
        candidates = [scheme]
    found: dict[str, Scheme] = {}  # by label: a scheme and its group size
    for rule in recipe.get("rules", ()):
        if rule.get("skip"):
            continue
        numerics = _numerics(rule)
        match = [_sized(s, numerics) for s in candidates if _matches(s, numerics)]
        if not match:
            which = f"scheme {candidates[0].name}" if named else "compressed-tensors scheme"
            raise ValueError(
                f"the recipe rule {rule.get('path_regex', '.*')!r} quantizes in a way no "
                f"{which} does; pass --recipe with a scheme ({names}), or a recipe whose "
                "quantizing rules are a scheme's (only skip rules added)"
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
    method, version and transform fields model_free_ptq adds, and the empty sparsity_config
    oneshot adds for the static schemes it alone writes); nothing of qmill's, since
    compressed-tensors refuses fields it does not know inside a group.
    """
    group = {
        "format": scheme.format,
        "input_activations": dict(scheme.input_activations) if scheme.input_activations else None,
        "output_activations": None,
        "targets": ["Linear"],
        "weights": dict(scheme.weights),
    }
    sparsity = {"sparsity_config": {}} if scheme.static_inputs else {}
    return sparsity | {
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
