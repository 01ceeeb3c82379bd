"""Loading checkpoints that are already quantized into a PTQ model, as the seeds do.

``process_prequantized_params`` turns a checkpoint whose quantized weights are ``{"qvalue",
"scale"[, "zero_point"]}`` dicts (and float arrays for the rest) into the pure dict ``nnx.update``
takes for an (abstract) NNX PTQ model: stored codes are kept when they are quantized the way the
model quantizes the weight; otherwise they are dequantized and quantized again as the model asks
(or dequantized for a float param). ``restore_quantization_rules`` reads the rules back from
such a checkpoint: one per module holding quantized weights.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from qmill.engine.core import qarray, qtypes
from qmill.engine.modeling import flax_util, rules
from qmill.engine.providers import ptq

_QUANTIZED_KEYS = frozenset({"qvalue", "scale", "zero_point"})
_DEFAULT = object()


def _is_quantized_entry(_: Any, x: Any) -> bool:
    return isinstance(x, Mapping) and "qvalue" in x


def _check_entry(entry: Mapping[str, Any], path: str) -> None:
    extra = set(entry) - _QUANTIZED_KEYS
    if extra:
        raise ValueError(
            f"{path}: a quantized entry holds only {sorted(_QUANTIZED_KEYS)}, not {sorted(extra)}."
        )
    if "scale" not in entry:
        raise ValueError(f"{path}: a quantized entry needs a 'scale' next to its 'qvalue'.")


def _resolve(template: Any, path: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any]:
    """The template's param at ``path``; a trailing "array" (our WithAux layout) is optional."""
    if path and path[-1] == "array":
        parent = ptq.get_value_from_path(template, path[:-1])
        if parent is not ptq._MISSING and not isinstance(
            flax_util.unbox(parent), qarray.QArray | dict
        ):
            return path[:-1], parent
    found = ptq.get_value_from_path(template, path)
    return path, (None if found is ptq._MISSING else found)


def _coerce(value: Any, like: Any, path: str, *, broadcast: bool = False) -> jax.Array:
    """value as an array with like's dtype, shape (scales may broadcast) and sharding."""
    like = flax_util.unbox(like)
    sharding = getattr(like, "sharding", None)
    out = jnp.asarray(value).astype(like.dtype)
    if out.shape != tuple(like.shape):
        if not broadcast:
            raise ValueError(
                f"{path}: shape {out.shape} in the checkpoint, the model has {like.shape}."
            )
        try:
            out = jnp.broadcast_to(out, like.shape)
        except ValueError:
            raise ValueError(
                f"{path}: scale shape {out.shape} does not broadcast to the model's {like.shape}."
            ) from None
    if isinstance(sharding, jax.sharding.Sharding):
        out = jax.device_put(out, sharding)
    return out


def _stored_qarray(entry: Mapping[str, Any]) -> qarray.QArray:
    return qarray.QArray(
        jnp.asarray(entry["qvalue"]), jnp.asarray(entry["scale"]), entry.get("zero_point")
    )


def _same_scheme(entry: Mapping[str, Any], template: qarray.QArray) -> bool:
    qvalue = flax_util.unbox(template.qvalue)
    scale = flax_util.unbox(template.scale)
    return (
        qtypes.name(jnp.asarray(entry["qvalue"]).dtype) == qtypes.name(template.qtype)
        and tuple(jnp.shape(entry["scale"])) == tuple(scale.shape)
        and tuple(jnp.shape(entry["qvalue"])) == tuple(qvalue.shape)
        and (entry.get("zero_point") is None) == (template.zero_point is None)
    )


def _quantized(entry: Mapping[str, Any], template: ptq.WithAux, path: str) -> qarray.QArray:
    target = flax_util.unbox(template.array)
    if _same_scheme(entry, target):
        zp = entry.get("zero_point")
        return qarray.QArray(
            _coerce(entry["qvalue"], target.qvalue, path),
            _coerce(entry["scale"], target.scale, path, broadcast=True),
            None if zp is None else _coerce(zp, target.zero_point, path, broadcast=True),
            qtype=target.qtype,
        )
    # Another scheme (qtype, channels, tiles): requantize the stored values as the model asks.
    values = qarray.dequantize(_stored_qarray(entry)).reshape(target.shape)
    return qarray.quantize(values.astype(flax_util.unbox(target.scale).dtype), template.how)


def process_prequantized_params(
    checkpoint_params: Mapping[str, Any],
    template_params: Any,
    *,
    allow_extra_params: bool = False,
    use_checkpoint_sharding: bool = False,
) -> dict[str, Any]:
    """A pre-quantized checkpoint as the pure dict ``nnx.update(template_params, ...)`` takes.

    Args:
      checkpoint_params: nested dict in the model's state paths; leaves are arrays or
        ``{"qvalue", "scale"[, "zero_point"]}`` dicts.
      template_params: the NNX PTQ model, possibly abstract (``nnx.eval_shape``).
      allow_extra_params: skip checkpoint entries the model lacks instead of raising.
      use_checkpoint_sharding: keep the checkpoint arrays' placement instead of the template's.

    Raises:
      TypeError: template_params is not an NNX model.
      ValueError: an entry the model lacks, a malformed quantized entry, a shape mismatch, or a
        float checkpoint param where the model holds a quantized one (use quantize_params).
    """
    if not isinstance(template_params, nnx.Module):
        raise TypeError(
            f"process_prequantized_params takes an NNX model, got {type(template_params).__name__}"
            "; for Linen, build the param tree with quantize_params."
        )
    out: dict[tuple[Any, ...], Any] = {}
    flat = flax.traverse_util.flatten_dict(dict(checkpoint_params), is_leaf=_is_quantized_entry)
    for path, entry in flat.items():
        path, template = _resolve(template_params, path)
        where = "/".join(map(str, path))
        if template is None:
            if allow_extra_params:
                continue
            raise ValueError(
                f"{where} is not in the model; pass allow_extra_params=True to skip it."
            )
        out[path] = _process(entry, template, where, use_checkpoint_sharding)
    return flax.traverse_util.unflatten_dict(out)


def _process(entry: Any, template: Any, where: str, keep_placement: bool) -> Any:
    template = flax_util.unbox(template)
    quantized_template = isinstance(template, ptq.WithAux) and isinstance(
        flax_util.unbox(template.array), qarray.QArray
    )
    if isinstance(entry, Mapping):
        _check_entry(entry, where)
        if quantized_template:
            qa = _quantized(entry, template, where)
            return {"array": ptq._pure(qa)}
        value = qarray.dequantize(_stored_qarray(entry))
    elif quantized_template:
        raise ValueError(
            f"{where}: the checkpoint holds float values but the model a quantized weight; "
            "quantize them with quantize_params."
        )
    else:
        value = entry
    if keep_placement:
        return jnp.asarray(value).astype(flax_util.unbox(template).dtype)
    return _coerce(value, template, where)


def restore_quantization_rules(
    checkpoint_params: Mapping[str, Any],
    rule_type: type[rules.QuantizationRule] = rules.QuantizationRule,
    *,
    tile_size: int | float | None = None,
    act_qtype: Any = _DEFAULT,
    **kwargs: Any,
) -> list[rules.QuantizationRule]:
    """Rules that quantize a model as a pre-quantized checkpoint was quantized.

    One rule per module holding ``{"qvalue", ...}`` entries: module_path is the module's path
    with integer keys (layer indices) as ``[^/]+``; weight_qtype the qvalue's dtype;
    "minmax" where a zero point is stored, else "absmax"; act_qtype the weight qtype unless
    given (None: weight-only). Later entries of a module replace earlier ones.

    Args:
      checkpoint_params: the checkpoint, as for process_prequantized_params.
      rule_type: QuantizationRule or QtRule (or a subclass).
      tile_size: the rules' tile_size (the checkpoint's scales can't say how they were tiled
        along contracting axes without the ops).
      act_qtype: the rules' act_qtype; default: each rule's weight qtype.
      **kwargs: more fields of every rule.
    """
    found: dict[str, rules.QuantizationRule] = {}
    flat = flax.traverse_util.flatten_dict(dict(checkpoint_params), is_leaf=_is_quantized_entry)
    for path, entry in flat.items():
        if not _is_quantized_entry(None, entry):
            continue
        # (..., module, param[, "array"]) -> the module's keys.
        module = (path[:-1] if path[-1] == "array" else path)[:-1]
        parts = ["[^/]+" if isinstance(p, int) else re.escape(str(p)) for p in module]
        module_path = "/".join(parts)
        weight_qtype = qtypes.name(jnp.asarray(entry["qvalue"]).dtype)
        found[module_path] = rule_type(
            module_path=module_path,
            weight_qtype=weight_qtype,
            act_qtype=weight_qtype if act_qtype is _DEFAULT else act_qtype,
            weight_calibration_method="minmax" if entry.get("zero_point") is not None else "absmax",
            tile_size=tile_size,
            **kwargs,
        )
    return list(found.values())
