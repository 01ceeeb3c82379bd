"""Rotary position embeddings as config.json describes them (every rope_type transformers reads,
in either spelling: rope_parameters or rope_scaling); rope.py computes their frequencies."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
_DEFAULT_THETA = {"gemma3_text": 1_000_000.0}
_GEMMA3_LOCAL_THETA = 10_000.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rope:
    """Rotary position embedding of one kind of layer, as transformers computes its inv_freq."""

    # "default" | "linear" | "dynamic" | "llama3" | "yarn" | "longrope".
    kind: str = "default"
    # Base wavelength (rope_theta).
    theta: float = 10_000.0
    # Scaling factor (linear, dynamic, llama3, yarn; longrope's attention factor).
    factor: float = 1.0
    # Fraction of head_dim that rotates (Phi-3 and others); the rest passes through.
    partial_rotary_factor: float = 1.0
    # max_position_embeddings of the config (dynamic's reference length, longrope's factor).
    max_position_embeddings: int = 2048
    # Pretraining context length (llama3, yarn, longrope).
    original_max_position_embeddings: int = 2048
    # llama3: wavelengths between original/high and original/low are smoothed.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn: the ramp's bounds in rotations (defaults 32 and 1), whether they are rounded.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    # yarn: mscale / mscale_all_dim (DeepSeek's attention factor); None when absent.
    mscale: float | None = None
    mscale_all_dim: float | None = None
    # yarn / longrope: cos and sin are multiplied by this; None = derived from the factor.
    attention_factor: float | None = None
    # longrope: per-frequency divisors up to / beyond the original context length.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


def ropes(arch: str, c: Mapping[str, Any]) -> tuple[Rope, Rope]:
    """The global and local (sliding layers') Rope, from either config.json spelling."""
    params = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if arch == "gemma3_text":
        if "full_attention" in params or "sliding_attention" in params:
            full = dict(params.get("full_attention") or {})
            local = dict(params.get("sliding_attention") or {})
        else:  # transformers 4: rope_scaling is the global layers' only
            full, local = dict(params), {}
        full.setdefault("rope_theta", c.get("rope_theta", _DEFAULT_THETA[arch]))
        local.setdefault("rope_theta", c.get("rope_local_base_freq", _GEMMA3_LOCAL_THETA))
        return _rope(arch, c, full), _rope(arch, c, local)
    params = dict(params)
    params.setdefault("rope_theta", c.get("rope_theta", _DEFAULT_THETA.get(arch, 10_000.0)))
    rope = _rope(arch, c, params)
    return rope, rope


def _rope(arch: str, c: Mapping[str, Any], p: Mapping[str, Any]) -> Rope:
    kind = p.get("rope_type", p.get("type")) or "default"
    if arch == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # Phi3Config's renaming
    if kind not in ROPE_TYPES:
        raise ValueError(f"{arch}: rope type {kind!r} is not supported; supported: {ROPE_TYPES}")
    max_pos = int(c.get("max_position_embeddings", 2048))
    original = p.get("original_max_position_embeddings", max_pos)
    if arch == "phi3" and c.get("original_max_position_embeddings") is not None:
        original = c["original_max_position_embeddings"]  # wins over rope_parameters' (Phi3)
    factor = p.get("factor")
    if factor is None:
        if kind in ("linear", "dynamic", "llama3"):
            raise ValueError(f"{arch}: rope type {kind!r} needs a factor")
        factor = max_pos / original if kind in ("yarn", "longrope") else 1.0
    partial = p.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    return Rope(
        kind=kind,
        theta=float(p["rope_theta"]),
        factor=float(factor),
        partial_rotary_factor=float(partial),
        max_position_embeddings=max_pos,
        original_max_position_embeddings=int(original),
        low_freq_factor=float(p.get("low_freq_factor", 1.0)),
        high_freq_factor=float(p.get("high_freq_factor", 4.0)),
        beta_fast=float(p.get("beta_fast") or 32.0),
        beta_slow=float(p.get("beta_slow") or 1.0),
        truncate=bool(p.get("truncate", True)),
        mscale=float_or_none(p.get("mscale")),
        mscale_all_dim=float_or_none(p.get("mscale_all_dim")),
        attention_factor=float_or_none(p.get("attention_factor")),
        short_factor=tuple(float(x) for x in p.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in p.get("long_factor") or ()),
    )


def float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)
