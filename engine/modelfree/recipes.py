"""Recipes: how the service quantizes the tensors of a checkpoint, chosen by tensor path.

A recipe is an ordered tuple of `TensorRule`s; the first rule whose `path_regex` fully matches a
tensor's path decides. It is the model-free counterpart of `rules.QuantizationRule`, which matches
module paths while a model runs: checkpoints quantized by the service have no model to run.

Path regexes are RE2 (google-re2): matching takes time linear in the path, whatever the pattern.
Recipes come from the network, and a backtracking engine let one pattern like `(a+)+$` hold a
server's event loop for tens of seconds. RE2 refuses the constructs that need backtracking
(backreferences, lookahead and lookbehind), and a recipe using them is refused when it arrives.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from qmill.engine.core import calibration, numerics, qtypes
from qmill.engine.modeling import linear_regex

CONVENTIONS = ("auto", "flax", "torch")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorRule:
    """One line of a recipe."""

    # Regex (RE2: Python's syntax without backreferences or lookaround) that must match the
    # whole tensor path.
    path_regex: str = ".*"
    # Logical qtype name ("int8", "int4", "float8_e4m3fn", "nf4", ...); None only with skip.
    qtype: str | None = None
    # Blocks of this many elements along the tile axis share a scale; None = one per channel.
    tile_size: int | None = None
    # Apply tile_size only where it divides the tile axis, one scale per channel elsewhere.
    tile_if_divisible: bool = False
    # Explicit {axis: tile} tiles; overrides tile_size.
    tiled_axes: tuple[tuple[int, int], ...] | None = None
    # "<method>[,<args>]": absmax[,f] | minmax[,f] | rms,f | fixed,lo,hi (docs/numerics-spec.md).
    calibration_method: str = "absmax"
    # Layout override: axes a matmul contracts (None = inferred from the path and shape).
    contracting_axes: tuple[int, ...] | None = None
    # Layout override: axes with one scale per index (None = inferred).
    channel_axes: tuple[int, ...] | None = None
    # Leave matching tensors in their original dtype.
    skip: bool = False
    # Also quantize 1-D tensors (biases, norms), which are otherwise kept.
    include_vectors: bool = False
    # dtype name of the scales; None = the tensor's own dtype.
    scale_dtype: str | None = None
    # "" (the reference's arithmetic) or "torch" (PyTorch's, as compressed-tensors quantizes).
    arithmetic: str = ""
    # nvfp4 only: the tensor's global scale (compressed-tensors' NVFP4 "tensor_group" strategy):
    # block scales are E4M3 of global_scale * absmax / 6, codes x / (scale / global_scale).
    # None: E4M3 block scales alone.
    global_scale: float | None = None

    def __post_init__(self) -> None:
        compiled = linear_regex.compile(self.path_regex, "rule path_regex")
        object.__setattr__(self, "_compiled", compiled)
        if self.skip:
            return
        if not self.qtype:
            raise ValueError(f"rule {self.path_regex!r} needs a qtype (e.g. 'int8') or skip=true")
        # Checked here, not when the first tensor meets the rule: a recipe is refused when it
        # arrives (QuantizeParams' first message, SubmitJob), never after work has started.
        try:
            qtypes.get(self.qtype)
        except ValueError as e:
            raise ValueError(f"rule {self.path_regex!r}: {e}") from None
        try:
            calibration.parse(self.calibration_method)
        except ValueError as e:
            raise ValueError(f"rule {self.path_regex!r}: {e}") from None
        if self.tile_size is not None and self.tile_size <= 0:
            raise ValueError(
                f"rule {self.path_regex!r}: tile_size must be positive, got {self.tile_size}"
            )
        if self.scale_dtype is not None:
            _check_scale_dtype(self.path_regex, self.scale_dtype)
        if self.arithmetic not in numerics.ARITHMETICS:
            raise ValueError(
                f"rule {self.path_regex!r}: arithmetic {self.arithmetic!r} is not one of "
                f"{list(numerics.ARITHMETICS)}"
            )
        if self.global_scale is not None:
            _check_global_scale(self.path_regex, self.qtype, self.global_scale)
        if (self.contracting_axes is None) != (self.channel_axes is None):
            raise ValueError(
                f"rule {self.path_regex!r}: a layout override needs both contracting_axes and "
                "channel_axes"
            )

    def matches(self, path: str) -> bool:
        return self._compiled.fullmatch(path) is not None  # type: ignore[attr-defined]


def _check_global_scale(rule: str, qtype: str, value: float) -> None:
    if qtypes.name(qtype) != "nvfp4":
        raise ValueError(f"rule {rule!r}: global_scale applies to qtype nvfp4 only, not {qtype}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"rule {rule!r}: global_scale must be finite and positive, got {value}")


def _check_scale_dtype(rule: str, name: str) -> None:
    try:
        dtype = jnp.dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"rule {rule!r}: scale_dtype must be a floating dtype such as 'float32' or "
            f"'bfloat16', got {name!r}"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """Ordered rules plus the checkpoint's layout convention."""

    rules: tuple[TensorRule, ...]
    # "flax": 2-D kernels are (in, out); "torch": 2-D weights are (out, in); "auto": by name.
    convention: str = "auto"
    # The compressed-tensors scheme the rules are (W4A8, INT8, ...), which names the output's
    # format where several schemes share their weights' numerics; quantizing ignores it.
    scheme: str = ""

    def __post_init__(self) -> None:
        if self.convention not in CONVENTIONS:
            raise ValueError(f"convention {self.convention!r} is not one of {CONVENTIONS}")

    def rule_for(self, path: str) -> TensorRule | None:
        return next((rule for rule in self.rules if rule.matches(path)), None)


def rule_from_mapping(fields: Mapping[str, Any]) -> TensorRule:
    """A rule from plain data (a recipe file's table), refusing unknown keys by name."""
    known = {f.name for f in dataclasses.fields(TensorRule)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown rule field(s) {unknown}; valid: {sorted(known)}")
    values = dict(fields)
    for key in ("contracting_axes", "channel_axes"):
        if values.get(key) is not None:
            values[key] = tuple(int(a) for a in values[key])
    if values.get("tiled_axes") is not None:
        values["tiled_axes"] = tuple(
            sorted((int(k), int(v)) for k, v in dict(values["tiled_axes"]).items())
        )
    return TensorRule(**values)


def recipe_from_mapping(fields: Mapping[str, Any]) -> Recipe:
    """A recipe from plain data: {"rules": [{...}, ...], "convention": "auto"}."""
    unknown = sorted(set(fields) - {"rules", "convention", "scheme"})
    if unknown:
        raise ValueError(
            f"unknown recipe field(s) {unknown}; valid: ['convention', 'rules', 'scheme']"
        )
    rules = []
    for index, rule in enumerate(fields.get("rules") or ()):
        try:
            rules.append(rule_from_mapping(rule))
        except (TypeError, ValueError) as e:
            raise ValueError(f"recipe rule {index}: {e}") from None
    if not rules:
        raise ValueError("a recipe needs at least one rule")
    return Recipe(
        rules=tuple(rules),
        convention=fields.get("convention", "auto"),
        scheme=str(fields.get("scheme") or ""),
    )
