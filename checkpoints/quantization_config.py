"""The `quantization_config` qmill writes into a Hugging Face folder's config.json.

Field names follow compressed-tensors' schema where one fits (config_groups of targets and
weights {num_bits, type, symmetric, strategy, group_size, dynamic, observer}, ignore,
quantization_status), so tools that read such configs find familiar fields. `quant_method` is
"qmill", not "compressed-tensors": the weights are stored in the Qwix PTQ layout
(`P/array/qvalue`, `P/array/scale`, `P/array/zero_point`), which compressed-tensors' loaders do
not read, and a loader that trusted a borrowed quant_method would misread them. The `qmill`
block holds what the schema cannot say: the exact recipe, the key layout and the tensor counts.
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import Any

from qmill.checkpoints import ct_reader

LAYOUT = "P/array/qvalue, P/array/scale, P/array/zero_point (P: the source tensor's own key)"


def _bits_and_type(qtype: str) -> tuple[int | None, str]:
    """num_bits and compressed-tensors' `type` ("int" or "float") of a qmill qtype name."""
    if qtype == "nf4":
        return 4, "nf4"  # a 16-entry lookup table: neither int nor float in the schema's sense
    match = re.fullmatch(r"u?int(\d+)", qtype)
    if match:
        return int(match.group(1)), "int"
    if qtype in ("mxfp4", "nvfp4") or qtype.startswith("float4"):
        return 4, "float"
    if qtype == "mxfp8" or qtype.startswith("float8"):
        return 8, "float"
    return None, "float"


def _weights(rule: dict[str, Any]) -> dict[str, Any]:
    qtype = str(rule["qtype"])
    bits, kind = _bits_and_type(qtype)
    method = str(rule.get("calibration_method", "absmax"))
    tiles = rule.get("tiled_axes")
    group = rule.get("tile_size")
    if tiles:
        group = sorted(dict(tiles).values())[0] if len(dict(tiles)) == 1 else None
    weights = {
        "num_bits": bits,
        "type": kind,
        # minmax calibration adds a zero point: the one asymmetric method.
        "symmetric": not method.startswith("minmax"),
        "strategy": "group" if group or tiles else "channel",
        "group_size": group,
        "dynamic": False,
        "observer": method,
    }
    if rule.get("tile_if_divisible"):
        weights["qmill_group_if_divisible"] = True  # per channel where the group does not divide
    return weights


def build(
    recipe: dict[str, Any],
    *,
    quantized: dict[str, str],
    kept: list[str],
    not_copied: list[str],
    beside: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The quantization_config of an output made with `recipe`.

    Args:
        recipe: the recipe as run (rules, convention).
        quantized: path -> stored qvalue dtype of every quantized tensor.
        kept: float tensors of rank >= 2 written unquantized (the schema's `ignore`).
        not_copied: files of the source left out of the output (other-format weights).
        beside: per-channel part name -> how many tensors have one (AWQ's awq_scale at
            P/awq_scale, SmoothQuant's inv_sq_scale); the field is left out when there are none.
    """
    groups = {}
    for i, rule in enumerate(r for r in recipe.get("rules", ()) if not r.get("skip")):
        groups[f"group_{i}"] = {
            "targets": [f"re:{rule.get('path_regex', '.*')}"],
            "weights": _weights(rule),
            "input_activations": None,
            "output_activations": None,
        }
    config = {
        "quant_method": "qmill",
        "format": "qmill-ptq",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": sorted(kept),
        "qmill": {
            "version": metadata.version("qmill"),
            "recipe": recipe,
            "layout": LAYOUT,
            "quantized_tensors": len(quantized),
            "qvalue_dtypes": sorted(set(quantized.values())),
            "not_copied": not_copied,
        },
    }
    if beside:
        # P/<name> beside P/array: the reference's WithAwqScale / WithSqScale params.
        config["qmill"]["beside_array"] = dict(sorted(beside.items()))
    return config


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
