"""One line on how a Hugging Face folder's config.json says its weights are quantized (`qmill
inspect`): qmill's own quantization_config (hf_folder/quantization_config.py) or
compressed-tensors' (its scheme by its preset's name where qmill knows it).
"""

from __future__ import annotations

from typing import Any

from qmill.checkpoints.formats.compressed_tensors import reader as ct_reader


def _strategy(weights: dict[str, Any]) -> str:
    """ "per channel", "in groups of 128": compressed-tensors' strategy, said in words."""
    strategy, size = weights.get("strategy"), weights.get("group_size")
    if strategy == "channel":
        return "per channel"
    if strategy != "group":
        return f"per {strategy}"
    text = f"in groups of {size}" if size else "in groups"
    if size and weights.get("qmill_group_if_divisible"):
        text += " (per channel where that does not divide)"
    return text


def describe(config: dict[str, Any]) -> str:
    """One line on how a config.json's weights are quantized ("not quantized" without one)."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        return "not quantized (no quantization_config)"
    method = qc.get("quant_method", "?")
    parts = []
    for group in (qc.get("config_groups") or {}).values():
        w = (group or {}).get("weights") or {}
        targets = ",".join(group.get("targets") or [])
        parts.append(f"{w.get('type')}{w.get('num_bits')} {_strategy(w)} on {targets}")
    detail = "; ".join(parts) or qc.get("format", "")
    if method == "compressed-tensors":
        # What vLLM dispatches on, and the Linear weights left in float; the scheme by its
        # preset's name where qmill knows it (oneshot names its group "group_0").
        try:
            names = ct_reader.scheme_of_config(qc).name
        except ValueError:
            names = ", ".join(qc.get("config_groups") or {})
        detail += f"; scheme {names}, format {qc.get('format')}, ignore {qc.get('ignore')}"
    return f"quantized ({method}): {detail}"
