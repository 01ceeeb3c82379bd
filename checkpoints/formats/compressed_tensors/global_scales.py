"""NVFP4's global scales, found before any tensor is quantized.

compressed-tensors' NVFP4 scale has two levels: E4M3 scales per group of 16, times a float32
global scale per tensor, 448 · 6 / absmax. Projections a serving stack fuses into one matmul
share it: q/k/v of an attention block, gate/up of an MLP (llm-compressor's fused sets), whose
global scale is that of their joint absmax. A tensor's codes depend on it, and the pipeline
quantizes one tensor at a time, so this pre-pass reads every tensor the recipe quantizes once,
takes each fused set's absmax (`find`, called by the run's plan, checkpoints/run/plan.py), and puts
each tensor's global scale into the recipe (`with_rules`: an exact-path rule with the scheme's
numerics and `global_scale`, ahead of the others). The recipe then travels as any other (a
server, replicas, a job), the fingerprint of a resumed run included.
"""

from __future__ import annotations

import re
from typing import Any

import ml_dtypes
import numpy as np

from qmill.checkpoints.formats.compressed_tensors import schemes as ct_schemes

# 448 (E4M3's max) · 6 (E2M1's max): the group scale of the tensor's absmax is then E4M3's max.
_NUMERATOR = np.float32(448.0 * 6.0)
# llm-compressor's fused sets (model_free microscale), matched on the whole tensor path.
FUSED_SETS = (
    (r".*(attn|attention)\.q_proj\.weight", r".*(attn|attention)\.k_proj\.weight",
     r".*(attn|attention)\.v_proj\.weight"),
    (r".*(attn|attention)\.wq_a\.weight", r".*(attn|attention)\.wkv_a_with_mqa\.weight"),
    (r".*mlp\.gate_proj\.weight", r".*mlp\.up_proj\.weight"),
    (r".*w1\.weight", r".*w3\.weight"),
)  # fmt: skip


# llm-compressor's fused sets again, as its model_free_ptq places them in a sharded folder: each
# partner goes to the shard of the set's primary (the first), which reads and writes them all.
_PRIMARIES = {
    r"(?P<prefix>.+?)\.(?P<attn>attn|attention|self_attn|self_attention)\.q_proj\.weight": (
        "{prefix}.{attn}.k_proj.weight",
        "{prefix}.{attn}.v_proj.weight",
    ),
    r"(?P<prefix>.+?)\.(?P<attn>attn|attention|self_attn)\.wq_a\.weight": (
        "{prefix}.{attn}.wkv_a_with_mqa.weight",
    ),
    r"(?P<prefix>.+?)\.(?P<mlp>mlp|feed_forward)\.gate_proj\.weight": (
        "{prefix}.{mlp}.up_proj.weight",
    ),
    r"(?P<prefix>.+?)\.w1\.weight": ("{prefix}.w3.weight",),
}


def partner_homes(paths: list[str]) -> dict[str, str]:
    """{partner tensor: its set's primary} for the fused sets among `paths` (the shard a
    partner's compressed tensors go to)."""
    present = set(paths)
    homes = {}
    for path in paths:
        for pattern, partners in _PRIMARIES.items():
            match = re.fullmatch(pattern, path)
            if match is None:
                continue
            for template in partners:
                partner = template.format(**match.groupdict())
                if partner in present:
                    homes[partner] = path
    return homes


def global_scale(absmax: float, dtype: np.dtype) -> float:
    """448 · 6 / absmax as PyTorch computes it on a tensor of `dtype` (a scalar divided by a
    tensor is its reciprocal times the scalar, each rounded to the dtype), stored as float32;
    1.0 where it is not finite (an all-zero tensor)."""
    tiny = np.float32(ml_dtypes.finfo(dtype).tiny)
    with np.errstate(over="ignore", divide="ignore"):
        reciprocal = _round(np.float32(1.0) / max(np.float32(absmax), tiny), dtype)
        value = _round(reciprocal * _NUMERATOR, dtype)
    return float(value) if np.isfinite(value) else 1.0


def _round(value: np.float32, dtype: np.dtype) -> np.float32:
    with np.errstate(over="ignore"):
        return np.float32(np.asarray(value, np.float32).astype(dtype).astype(np.float32))


def _absmax(array: np.ndarray) -> float:
    return float(np.abs(np.asarray(array).astype(np.float32)).max())


def _natural(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def fused_sets(paths: list[str]) -> list[list[str]]:
    """The fused sets among `paths`, as llm-compressor forms them: in natural order, each
    pattern of a set filled once, a set closed when every pattern has its tensor."""
    found = []
    ordered = sorted(paths, key=_natural)
    for patterns in FUSED_SETS:
        compiled = [re.compile(p) for p in patterns]
        current: list[str | None] = [None] * len(patterns)
        for path in ordered:
            for i, pattern in enumerate(compiled):
                if pattern.fullmatch(path):
                    current[i] = path
            if all(current):
                found.append([p for p in current if p is not None])
                current = [None] * len(patterns)
    return found


def find(source: Any, scheme: ct_schemes.Scheme, quantized: list[Any]) -> dict[str, float]:
    """{tensor path: its global scale} for the tensors an NVFP4 scheme quantizes (`quantized`,
    entries in checkpoint order): 448 · 6 / the absmax of the tensor, or of its fused set's
    tensors together; {} for any other scheme. Reads each of them once."""
    if scheme.format != ct_schemes.NVFP4 or getattr(source, "format", "") != "safetensors":
        return {}
    absmax = {e.path: _absmax(source.read(e.path)) for e in quantized}
    dtype = {e.path: np.dtype(e.dtype) for e in quantized}
    groups = {p: [p] for p in absmax}
    for members in fused_sets([e.path for e in source.entries()]):
        joint = [p for p in members if p in absmax]
        for p in joint:
            groups[p] = joint
    return {
        path: global_scale(max(absmax[p] for p in group), dtype[path])
        for path, group in groups.items()
    }


def with_rules(
    recipe: dict[str, Any], scheme: ct_schemes.Scheme, scales: dict[str, float]
) -> dict[str, Any]:
    """`recipe` with an exact-path rule per tensor of `scales`, the scheme's numerics and its
    `global_scale`, ahead of the others: the recipe a server, a job and a resumed run's
    fingerprint get; `recipe` itself when there are none."""
    if not scales:
        return recipe
    rules = [
        {"path_regex": re.escape(path), **scheme.rule, "global_scale": scale}
        for path, scale in scales.items()
    ]
    return {**recipe, "rules": [*rules, *recipe.get("rules", ())]}


def global_scales(recipe: dict[str, Any]) -> dict[str, float]:
    """{tensor path: global scale} of the rules with_rules added."""
    out = {}
    for rule in recipe.get("rules", ()):
        if rule.get("global_scale"):
            out[re.sub(r"\\(.)", r"\1", rule["path_regex"])] = float(rule["global_scale"])
    return out
