"""compressed-tensors in: a folder llm-compressor (or qmill) wrote, as the Qwix PTQ param tree.

The weights of module M stored in compressed-tensors' layout (ct_layout) become the leaf
`M.weight` = {"array": {"qvalue", "scale"[, "zero_point"]}} that qmill's own outputs hold, with
the same codes and scales: `qvalue * scale` (minus the zero point, per group) is the weight
compressed-tensors decompresses. PyTorch's (out, in) layout is kept, or transposed to Flax's
(in, out) kernels on request (`flax_layout`): every part of a quantized leaf is transposed, so
its scale stays aligned with its tiles.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from qmill.checkpoints import ct_layout, ct_schemes, writer_base

# The QuantizationArgs fields that decide the stored layout and numbers.
_DECIDING = ("num_bits", "type", "strategy", "symmetric", "group_size", "block_structure")


def config_of(source: Any) -> dict[str, Any] | None:
    """The compressed-tensors quantization_config of an opened source, None if it has none:
    a Hugging Face folder's config.json, or a safetensors file's __metadata__ (ct_writer)."""
    config = getattr(source, "config", None)
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    if qc is None:
        weights = getattr(source, "weights", source)
        text = (getattr(weights, "metadata", None) or {}).get("quantization_config")
        qc = json.loads(text) if text else None
    if isinstance(qc, dict) and qc.get("quant_method") == ct_schemes.FORMAT:
        return qc
    return None


def scheme_of_config(qc: Mapping[str, Any]) -> ct_schemes.Scheme:
    """The scheme of a compressed-tensors config with one weight group: the one its weights,
    format and input activations are, the group's name deciding between aliases (W8A8, INT8).

    Raises:
        ValueError: several groups, or a group no scheme qmill reads describes.
    """
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(
            f"this compressed-tensors checkpoint has {len(groups)} config groups; qmill reads "
            "checkpoints of one scheme"
        )
    ((name, group),) = groups.items()
    weights = group.get("weights") or {}
    inputs = group.get("input_activations") or {}
    fmt = group.get("format") or qc.get("format")
    found = []
    for scheme in ct_schemes.SCHEMES.values():
        size = weights.get("group_size")
        if scheme.grouped and isinstance(size, int) and size > 0:
            scheme = scheme.with_group_size(size)  # any group size (--group-size)
        theirs = scheme.input_activations or {}
        if (
            scheme.format == fmt
            and all(weights.get(k) == scheme.weights.get(k) for k in _DECIDING)
            and all(inputs.get(k) == theirs.get(k) for k in (*_DECIDING, "dynamic"))
        ):
            found.append(scheme)
    if found:
        return next((s for s in found if s.name == str(name).upper()), found[0])
    shown = {k: weights.get(k) for k in _DECIDING}
    raise ValueError(
        f"qmill does not read compressed-tensors format {fmt!r} with weights {shown}; it reads "
        f"the schemes {', '.join(ct_schemes.SCHEMES)}"
    )


def to_qwix(
    flat: dict[str, np.ndarray], qc: Mapping[str, Any], *, flax_layout: bool = False
) -> dict[str, np.ndarray]:
    """`flat` (tensor name -> array, as stored) with every compressed weight as its Qwix parts
    under `M.weight/array/{qvalue,scale,zero_point}`; other tensors as they are."""
    scheme = scheme_of_config(qc)
    packed = scheme.format in ("pack-quantized", *ct_layout.FP4_FORMATS)
    marker = ct_layout.PACKED if packed else ct_layout.SCALE
    modules = [k[: -len(marker) - 1] for k in flat if k.endswith("." + marker)]
    out = dict(flat)
    for module in modules:
        parts = ct_layout.decompress(scheme, module, flat)
        for suffix in (
            "weight",
            ct_layout.PACKED,
            ct_layout.SCALE,
            ct_layout.SHAPE,
            ct_layout.ZERO_POINT,
            ct_layout.GLOBAL_SCALE,
        ):
            out.pop(f"{module}.{suffix}", None)
        for name, array in parts.items():
            value = array.T.copy() if flax_layout else array
            out[writer_base.quantized_key(f"{module}.weight", name)] = value
    return out
