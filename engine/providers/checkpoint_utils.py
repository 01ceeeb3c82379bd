"""Loading checkpoints that are already quantized into a PTQ model, as the seeds do.

``process_prequantized_params`` turns a checkpoint whose quantized weights are ``{"qvalue",
"scale"[, "zero_point"]}`` dicts (and float arrays for the rest) into the pure dict ``nnx.update``
takes for an (abstract) NNX PTQ model: stored codes are kept when they are quantized the way the
model quantizes the weight; otherwise they are dequantized and quantized again as the model asks
(or dequantized for a float param). ``restore_quantization_rules`` reads the rules back from
such a checkpoint: one per module holding quantized weights.
"""

from __future__ import annotations

import logging
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

logger = logging.getLogger(__name__)

_QUANTIZED_KEYS = frozenset({"qvalue", "scale", "zero_point"})
_DEFAULT = object()


def _is_quantized_entry(_: Any, x: Any) -> bool:
    return isinstance(x, Mapping) and "qvalue" in x


def _check_entry(entry: Mapping[str, Any], path: str) -> None:
    extra = set(entry) - _QUANTIZED_KEYS
    if extra:
        raise ValueError(
            f"{path} has unsupported quantized leaves {sorted(extra)}. Expected only "
            f"{sorted(_QUANTIZED_KEYS)}."
        )
    if "scale" not in entry:
        raise ValueError(
            f'{path} is missing required "qvalue" or "scale" in pre-quantized dictionary. '
            f"Found keys: {sorted(entry)}; a quantized entry needs a 'scale' next to its 'qvalue'."
        )


def _quantized_template(template: Any) -> qarray.QArray | None:
    """The QArray a template param stands for: a WithAux's, a QArray, or a plain dict of
    {"qvalue", "scale"[, "zero_point"]} (a model that holds its quantized weight as a dict,
    possibly under "array"), as the reference accepts; None for a float param."""
    template = flax_util.unbox(template)
    if isinstance(template, ptq.WithAux):
        template = flax_util.unbox(template.array)
    if isinstance(template, Mapping) and "array" in template:
        template = template["array"]
    if isinstance(template, Mapping) and {"qvalue", "scale"} <= set(template):
        zp = template.get("zero_point")
        qvalue = flax_util.unbox(template["qvalue"])
        return qarray.QArray(
            qvalue, flax_util.unbox(template["scale"]), flax_util.unbox(zp), qtype=qvalue.dtype
        )
    return template if isinstance(template, qarray.QArray) else None


def _how_of(template: Any, target: qarray.QArray) -> qarray.HowToQuantize:
    """How the model quantizes the param: the WithAux's; else read from the scale's shape (one
    scale per index: channelwise; fewer: tiled), with "minmax" where a zero point is held."""
    template = flax_util.unbox(template)
    if isinstance(template, ptq.WithAux):
        return template.how
    qshape, sshape = tuple(target.qvalue.shape), tuple(target.scale.shape)
    channelwise = [a for a, (q, s) in enumerate(zip(qshape, sshape, strict=True)) if q == s]
    tiled = {
        a: q // s for a, (q, s) in enumerate(zip(qshape, sshape, strict=True)) if s not in (1, q)
    }
    return qarray.HowToQuantize(
        qtype=target.qtype,
        channelwise_axes=channelwise,
        tiled_axes=tiled,
        calibration_method="absmax" if target.zero_point is None else "minmax",
    )


def _resolve(template: Any, path: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any]:
    """The template's param at ``path``; a trailing "array" (our WithAux layout) is optional:
    it names the WithAux, or a float param that has no ``array`` of its own (as the reference,
    a param whose value carries an ``array`` attribute is matched at the full path)."""
    found = ptq.get_value_from_path(template, path)
    if path and path[-1] == "array":
        parent = ptq.get_value_from_path(template, path[:-1])
        unboxed = flax_util.unbox(parent)
        if isinstance(unboxed, ptq.WithAux) or (
            found is ptq._MISSING
            and parent is not ptq._MISSING
            and not isinstance(unboxed, qarray.QArray | dict)
        ):
            return path[:-1], parent
    return path, (None if found is ptq._MISSING else found)


def _placement(like: Any, path: str) -> Any:
    """The sharding to put a value like ``like`` on; a NamedSharding of an AbstractMesh (an
    abstract model's) is made concrete on the active mesh (``jax.set_mesh``), as the reference."""
    sharding = getattr(flax_util.unbox(like), "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding):
        return None
    mesh = getattr(sharding, "mesh", None)
    if isinstance(mesh, jax.sharding.AbstractMesh):
        concrete = jax.sharding.get_mesh()
        if concrete.empty:
            raise ValueError(
                f"{path} requires an active mesh to place pre-quantized arrays. Run "
                "process_prequantized_params inside the jax.set_mesh(...) of the sharded model."
            )
        return jax.sharding.NamedSharding(concrete, sharding.spec)
    return sharding


def _coerce(value: Any, like: Any, path: str, *, broadcast: bool = False) -> jax.Array:
    """value as an array with like's dtype, shape (scales may broadcast) and sharding."""
    sharding = _placement(like, path)
    like = flax_util.unbox(like)
    out = jnp.asarray(value).astype(like.dtype)
    if out.shape != tuple(like.shape):
        if not broadcast:
            raise ValueError(f"{path} has shape {out.shape}, expected {tuple(like.shape)}.")
        try:
            out = jnp.broadcast_to(out, like.shape)
        except ValueError:
            raise ValueError(
                f"{path} has shape {out.shape}, expected {tuple(like.shape)} (a scale must "
                "broadcast to the model's)."
            ) from None
    if sharding is not None:
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


def _quantized(entry: Mapping[str, Any], template: Any, path: str) -> qarray.QArray:
    target = _quantized_template(template)
    if entry.get("zero_point") is not None and target.zero_point is None:
        # As the reference: requantizing would silently drop the offset the codes were made with.
        raise ValueError(
            f'{path} provided an unexpected "zero_point" for a symmetric quantized param.'
        )
    if _same_scheme(entry, target):
        zp = entry.get("zero_point")
        return qarray.QArray(
            _coerce(entry["qvalue"], target.qvalue, path),
            _coerce(entry["scale"], target.scale, path, broadcast=True),
            None if zp is None else _coerce(zp, target.zero_point, path, broadcast=True),
            qtype=target.qtype,
        )
    # Another scheme (qtype, channels, tiles): requantize the stored values as the model asks.
    values = qarray.dequantize(_stored_qarray(entry))
    if values.shape != tuple(target.shape):
        raise ValueError(f"{path} has shape {values.shape}, expected {tuple(target.shape)}.")
    scale_dtype = flax_util.unbox(target.scale).dtype
    return qarray.quantize(values.astype(scale_dtype), _how_of(template, target))


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
        # The reference's message first (code matching it keeps working), then the fix.
        raise TypeError(
            "process_prequantized_params only supports NNX PTQ/QT models. Got "
            f"{type(template_params)}. It fills NNX models (possibly abstract, nnx.eval_shape); "
            "for Linen, build the param tree with quantize_params."
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
                "Found extra parameters in prequantized_params not present in template: "
                f"{where}; pass allow_extra_params=True to skip them."
            )
        out[path] = _process(entry, template, where, use_checkpoint_sharding)
    return flax.traverse_util.unflatten_dict(out)


def _process(entry: Any, template: Any, where: str, keep_placement: bool) -> Any:
    quantized_template = _quantized_template(template) is not None
    template = flax_util.unbox(template)
    if isinstance(entry, Mapping):
        _check_entry(entry, where)
        if quantized_template:
            qa = _quantized(entry, template, where)
            return {"array": ptq._pure(qa)} if _holds_array(template) else ptq._pure(qa)
        value = qarray.dequantize(_stored_qarray(entry))
    elif quantized_template:
        raise ValueError(
            f"Unhandled or invalid parameter combination for {where}: the checkpoint holds float "
            "values but the model a quantized weight; quantize them with quantize_params."
        )
    else:
        value = entry
    if keep_placement:
        return jnp.asarray(value).astype(flax_util.unbox(template).dtype)
    return _coerce(value, template, where)


def _holds_array(template: Any) -> bool:
    # Our WithAux (and a dict template spelled {"array": {...}}) nest the codes under "array".
    return isinstance(template, ptq.WithAux) or (
        isinstance(template, Mapping) and "array" in template
    )


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
    given (None: weight-only). Later entries of a module replace earlier ones, with a warning
    where they ask for another rule (as the reference).

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
        rule = rule_type(
            module_path=module_path,
            weight_qtype=weight_qtype,
            act_qtype=weight_qtype if act_qtype is _DEFAULT else act_qtype,
            weight_calibration_method="minmax" if entry.get("zero_point") is not None else "absmax",
            tile_size=tile_size,
            **kwargs,
        )
        if module_path in found and found[module_path] != rule:
            # As the reference: one module's params quantized two ways can't both be replayed.
            logger.warning(
                "Conflicting quantization rules reconstructed for %s. Existing: %s, New: %s. "
                "The existing rule will be overwritten.",
                module_path,
                found[module_path],
                rule,
            )
        found[module_path] = rule
    return list(found.values())
