"""Post-training quantization (PTQ): quantized weights stored in the model, quantized compute.

The provider can't know how to quantize a weight until an op uses it (the op decides which axes
are contracted). So a PTQ model is initialised with float weights, and the first time an op meets
a float weight it quantizes it and *replaces* the param with a ``WithAux`` (the QArray plus how it
was quantized). Under ``jax.eval_shape`` / ``nnx.eval_shape`` this only produces shapes, so float
weights are never materialised. ``quantize_params`` later uses the ``how`` recorded in an
(abstract) PTQ param tree to quantize float checkpoints without running the model.

Param layout: a quantized weight is ``<name>/array/{qvalue,scale[,zero_point]}`` and a static
activation scale ``<op_id>_{lhs,rhs}_scale/array`` (+ ``..._zero_point``) in the module's params.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import flax.struct
import jax
import numpy as np
from flax import linen as nn
from flax import nnx

from qmill.engine.core import averaging, qarray
from qmill.engine.modeling import flax_util, provenance, rules
from qmill.engine.ops import op_adapter
from qmill.engine.providers import base

A = TypeVar("A", jax.Array, qarray.QArray)

# Views a PTQ weight may go through: the stored QArray already has the compute shape, so a module's
# reshape is a no-op on it; a transpose would have to be replayed by quantize_params, which only
# reshapes, so it is refused rather than silently mis-quantized.
_PTQ_VIEWS = frozenset({"reshape", "squeeze", "astype"})


@flax.struct.dataclass
class WithAux(Generic[A]):
    """An array or QArray plus how it was quantized, so that quantize_params can redo it."""

    array: A
    how: qarray.HowToQuantize = flax.struct.field(pytree_node=False)

    # Looks like an nnx.Variable / array to module code that reads the param.
    value = property(lambda self: flax_util.unbox(self))
    shape = property(lambda self: tuple(flax_util.unbox(self.array).shape))
    ndim = property(lambda self: len(self.shape))
    dtype = property(lambda self: flax_util.unbox(self.array).dtype)

    def get_value(self) -> WithAux[A]:
        return flax_util.unbox(self)

    def __jax_array__(self) -> jax.Array:
        """``jnp.asarray(w)``: the array, dequantized if it is a QArray."""
        array = flax_util.unbox(self.array)
        return qarray.dequantize(array) if isinstance(array, qarray.QArray) else array

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.__jax_array__(), dtype=dtype)

    def __getitem__(self, key: Any) -> WithAux[A]:
        if key is Ellipsis:  # nnx modules read params with `variable[...]`
            return flax_util.unbox(self)
        raise TypeError(f"a quantized weight can only be read whole (`[...]`), not with [{key!r}]")

    def astype(self, dtype: Any) -> WithAux[A]:
        """The weight cast to ``dtype`` (a QArray's scale), its box (axis names) kept, as the
        reference's."""
        value = flax_util.unbox(self.array).astype(dtype)
        if isinstance(self.array, nnx.Variable | nn.meta.AxisMetadata):
            value = flax_util.update_boxed(self.array, value)
        return self.replace(array=value)

    def reshape(self, *shape: Any) -> WithAux[A]:
        if len(shape) == 1 and not isinstance(shape[0], int):
            shape = tuple(shape[0])
        if tuple(shape) != self.shape:
            raise ValueError(
                f"PTQ weights are stored in the shape their op uses, {self.shape}, but the module "
                f"asks for {tuple(shape)}."
            )
        return self


class PtqProvider(base.OpsProvider):
    """Quantized weights (replaced in the model on first use) and quantized compute.

    ``PtqProvider(rules)`` or ``PtqProvider(rules=rules)``.
    """

    # ---- ops -------------------------------------------------------------------------------

    def dot_general(
        self,
        lhs: Any,
        rhs: Any,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        **kwargs: Any,
    ) -> jax.Array:
        rule, op_id, module = self.current_rule_and_op_id("dot_general")
        if rule is None or rule.weight_qtype is None:
            return jax.lax.dot_general(
                lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs
            )
        return self.quantized_dot_general(rule, op_id, module, lhs, rhs, dimension_numbers)

    def quantized_dot_general(self, rule, op_id, module, lhs, rhs, dimension_numbers) -> jax.Array:
        how = op_adapter.dot_general_how(rule, lhs, rhs, dimension_numbers)
        lhs, rhs = self._prepare_operands(lhs, rhs, how, rule, op_id, module)
        return op_adapter.dot_general(lhs, rhs, dimension_numbers)

    def einsum(self, einsum_str: Any, *operands: Any, **kwargs: Any) -> jax.Array:
        rule, op_id, module = self.current_rule_and_op_id("einsum")
        if rule is None or rule.weight_qtype is None:
            return jax.numpy.einsum(einsum_str, *operands, **kwargs)
        if not isinstance(einsum_str, str) or len(operands) != 2:
            raise ValueError(
                f"quantized einsum takes a string and two operands, got {einsum_str!r} with "
                f"{len(operands)} operands"
            )
        return self.quantized_einsum(rule, op_id, module, einsum_str, *operands)

    def quantized_einsum(self, rule, op_id, module, einsum_str, lhs, rhs) -> jax.Array:
        how = op_adapter.einsum_how(rule, lhs, rhs, einsum_str)
        lhs, rhs = self._prepare_operands(lhs, rhs, how, rule, op_id, module)
        return op_adapter.einsum(einsum_str, lhs, rhs)

    def conv_general_dilated(
        self, lhs: Any, rhs: Any, window_strides: Any, padding: Any, *args: Any, **kwargs: Any
    ) -> jax.Array:
        rule, op_id, module = self.current_rule_and_op_id("conv_general_dilated")
        if rule is None or rule.weight_qtype is None:
            return jax.lax.conv_general_dilated(lhs, rhs, window_strides, padding, *args, **kwargs)
        call = _ConvCall.bind(window_strides, padding, *args, **kwargs)
        return self.quantized_conv_general_dilated(rule, op_id, module, lhs, rhs, call)

    def quantized_conv_general_dilated(self, rule, op_id, module, lhs, rhs, call) -> jax.Array:
        if rule.act_qtype is not None and rule.act_qtype != rule.weight_qtype:
            raise ValueError(
                "quantized conv_general_dilated needs act_qtype == weight_qtype (or act_qtype "
                f"None); got {rule.act_qtype=} {rule.weight_qtype=}"
            )
        dn = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, call.dimension_numbers)
        how = op_adapter.conv_how(rule, dn)
        lhs, rhs = self._prepare_operands(lhs, rhs, how, rule, op_id, module)
        return op_adapter.conv_general_dilated(lhs, rhs, **call.quantized_kwargs(dn))

    def ragged_dot(self, lhs: Any, rhs: Any, group_sizes: Any, *args: Any, **kwargs: Any):
        """jax.lax.ragged_dot (lhs [m, k], rhs [groups, k, n]): the usual MoE expert weights."""
        rule, op_id, module = self.current_rule_and_op_id("ragged_dot")
        if rule is None or rule.weight_qtype is None:
            return jax.lax.ragged_dot(lhs, rhs, group_sizes, *args, **kwargs)
        how = op_adapter.ragged_dot_how(rule)
        lhs, rhs = self._prepare_operands(lhs, rhs, how, rule, op_id, module)
        return op_adapter.ragged_dot(lhs, rhs, group_sizes, *args, **kwargs)

    def nn_param(self, module: nn.Module, name: str, *args: Any, **kwargs: Any) -> Any:
        """Linen Module.param: an already-quantized param is returned as is (no shape check)."""
        existing = module.get_variable("params", name)
        if isinstance(existing, WithAux):
            return nn.unbox(existing)
        return super().nn_param(module, name, *args, **kwargs)

    def asarray(self, a: Any, dtype: Any = None, *args: Any, **kwargs: Any) -> Any:
        """jnp.asarray in a PTQ model, as the reference: a quantized weight (WithAux, QArray, in a
        box or not) stays quantized (cast to ``dtype``'s scale) for the op that reads it; a
        float array converts as usual, a param keeping its identity as a weight."""
        value = flax_util.unbox(a) if isinstance(a, nnx.Variable | nn.meta.AxisMetadata) else a
        if isinstance(value, Mapping) and "array" in value:
            # A quantized weight's state (nnx.state(model)["kernel"]): its QArray, as the reference.
            parts = flax_util.unbox(dict(value["array"]))
            if {"qvalue", "scale"} <= set(parts):
                value = qarray.QArray(parts["qvalue"], parts["scale"], parts.get("zero_point"))
        if isinstance(value, WithAux):
            return value.replace(array=self.asarray(flax_util.unbox(value.array), dtype))
        if isinstance(value, qarray.QArray):
            return value if dtype is None or value.dtype == dtype else value.astype(dtype)
        return _float_asarray()(a, dtype, *args, **kwargs)

    def get_intercept_map(self) -> dict[str, Any]:
        return super().get_intercept_map() | {"jax.numpy.asarray": self.asarray}

    # ---- operands ----------------------------------------------------------------------------

    def _prepare_operands(self, lhs, rhs, how, rule, op_id, module) -> tuple[Any, Any]:
        out = []
        for side, x in (("lhs", lhs), ("rhs", rhs)):
            for_lhs = side == "lhs"
            quantized = isinstance(x, WithAux | qarray.QArray)
            ref = None if quantized else flax_util.find_param(x, module)
            if isinstance(x, WithAux):
                x = x.array
            elif quantized:
                pass  # a QArray the model code took out of its weight (jnp.asarray, .array)
            elif ref is not None and not (for_lhs and _params_frozen(module)):
                x = self.quantize_weight(module, ref, x, how.weight(for_lhs)).array
            elif rule.act_qtype is not None:
                name = None if op_id is None else f"{op_id}_{side}"
                x = self.quantize_act(module, x, how.act(for_lhs), rule, name)
            out.append(x)
        return out[0], out[1]

    def quantize_weight(self, module, ref, value, how) -> WithAux[qarray.QArray]:
        """Quantizes a float weight met by an op and replaces the param in its module."""
        return create_quantized_param(module, ref, value, how)

    def quantize_act(self, module, array, how, rule, act_name) -> qarray.QArray:
        return quantize_act(array, how, rule, act_name, module=module)


def _params_frozen(module: Any) -> bool:
    """A Linen model applied without mutable params: a float weight can't be replaced by its
    quantized form. An lhs one (``jnp.asarray(w) @ x``) then computes as an activation, as the
    reference's PTQ treats every lhs; an rhs one still raises, as there."""
    return (
        isinstance(module, nn.Module)
        and not module.is_initializing()
        and not module.is_mutable_collection("params")
    )


@functools.cache
def _float_asarray() -> Any:
    # jnp.asarray through provenance's view handler: a float param stays known as a weight.
    return provenance.view_handlers()["jax.numpy.asarray"]


class _ConvCall:
    """The optional arguments of lax.conv_general_dilated, by name."""

    _NAMES = (
        "lhs_dilation",
        "rhs_dilation",
        "dimension_numbers",
        "feature_group_count",
        "batch_group_count",
        "precision",
        "preferred_element_type",
    )

    def __init__(self, window_strides, padding, values: dict[str, Any]) -> None:
        self.window_strides, self.padding, self.values = window_strides, padding, values
        self.dimension_numbers = values.get("dimension_numbers")

    @classmethod
    def bind(cls, window_strides, padding, *args: Any, **kwargs: Any) -> _ConvCall:
        values = dict(zip(cls._NAMES, args, strict=False)) | kwargs
        return cls(window_strides, padding, values)

    def quantized_kwargs(self, dn: Any) -> dict[str, Any]:
        kept = ("lhs_dilation", "rhs_dilation", "feature_group_count", "batch_group_count")
        out = {k: self.values[k] for k in kept if self.values.get(k) is not None}
        return out | {
            "window_strides": self.window_strides,
            "padding": self.padding,
            "dimension_numbers": dn,
        }


def create_quantized_param(
    module: Any,
    ref: provenance.WeightRef,
    value: jax.Array,
    how: qarray.HowToQuantize,
    *,
    quantize: Callable[..., qarray.QArray] = qarray.quantize,
) -> WithAux[qarray.QArray]:
    """Quantizes ``value`` (by ``quantize``: contrib.padded_ptq pads first) and stores it as the
    param ``ref.name`` of ``module``."""
    bad = [v for v in ref.views if v not in _PTQ_VIEWS]
    if bad:
        raise ValueError(
            f"param {ref.name!r} reaches a quantized op through {bad}; PTQ stores weights in the "
            "op's layout and can only follow reshapes. Store the param in the layout the op "
            "uses, or exclude this module from the rules."
        )
    if (
        isinstance(module, nn.Module)
        and not module.is_initializing()
        and not module.is_mutable_collection("params")
    ):
        raise ValueError(
            f"param {ref.name!r} of module {'/'.join(module.path)!r} is unquantized but the model "
            "is quantized: quantize the params with quantize_params(), or pass mutable=True."
        )
    unboxed = WithAux(quantize(value, how), how)
    flax_util.replace_param(module, ref.name, unboxed)
    return unboxed


_RUNNING = object()  # quantize_act's default module: the running one, if any


def quantize_act(
    array: jax.Array,
    how: qarray.HowToQuantize,
    rule: rules.QuantizationRule,
    act_name: str | None,
    *,
    module: Any = _RUNNING,
    quantize: Callable[..., qarray.QArray] = qarray.quantize,
) -> qarray.QArray:
    """Quantizes an activation, with a static scale stored as a param of ``module`` (default: the
    running one) if the rule asks for it, else by ``quantize`` (the reference's signature)."""
    if module is _RUNNING:
        module = flax_util.current_module_and_call()[0]
    if not rule.resolved_act_static_scale or module is None or act_name is None:
        return quantize(array, how)
    # An NNX PTQ model converted from a QT one finds the QT statistics here and consumes them.
    stat = flax_util.get_and_delete_variable("quant_stats", act_name, module=module)
    if stat is not None:
        _check_collected(stat, module, act_name)
    created_zero_point = []

    def init() -> WithAux[jax.Array]:
        calibration = (
            averaging.calibration(stat) if stat is not None else qarray.calibrate(array, how)
        )
        calibration = {
            k: v.mean(axis=tuple(rule.act_batch_axes), keepdims=True)
            for k, v in calibration.items()
        }
        scale, zero_point = qarray.compute_scale_zero_point(calibration, how.qtype)
        created_zero_point.append(zero_point)
        return WithAux(scale, how)

    scale = flax_util.get_or_create_param(f"{act_name}_scale", init, module=module)
    zp_name = f"{act_name}_zero_point"
    if created_zero_point and created_zero_point[0] is not None:
        zero_point = flax_util.get_or_create_param(
            zp_name, lambda: created_zero_point[0], module=module
        )
    else:
        zero_point = flax_util.get_variable(module, "params", zp_name)
    return qarray.quantize_with_scale_zero_point(array, how.qtype, scale.array, zero_point)


def _check_collected(stat: Any, module: Any, act_name: str) -> None:
    """Refuses a statistic that saw no batch: it would average to zeros and give scale 1.0."""
    count = stat["count"]
    if isinstance(count, jax.core.Tracer) or int(count) > 0:
        return
    where = "/".join((*flax_util.module_path(module), act_name))
    raise ValueError(
        f"the activation statistics of {where} were never collected (count 0): run the QT model "
        "on calibration batches before converting it to PTQ, or drop act_static_scale."
    )


_MISSING = object()


def get_value_from_path(obj: Any, path: Sequence[Any]) -> Any:
    """Follows ``path`` through dicts, NNX modules and Linen boxes; _MISSING if absent."""
    for key in path:
        obj = nn.meta.unbox(obj) if isinstance(obj, nn.meta.AxisMetadata) else obj
        mapping = isinstance(obj, dict | flax.core.FrozenDict)
        obj = obj.get(key, _MISSING) if mapping else getattr(obj, str(key), _MISSING)
        if obj is _MISSING:
            return _MISSING
    return obj


def _pure(x: Any) -> Any:
    """WithAux / QArray -> the nested dict nnx.to_pure_dict would produce for them."""
    if isinstance(x, WithAux):
        return {"array": _pure(x.array)}
    if isinstance(x, qarray.QArray):
        zero_point = {} if x.zero_point is None else {"zero_point": x.zero_point}
        return {"qvalue": x.qvalue, "scale": x.scale, **zero_point}
    return x


def quantize_params(
    params: Any,
    abstract_quantized_params: Any,
    quant_stats: Any = flax.core.FrozenDict(),  # noqa: B008 - immutable, as in the seeds
    *,
    allow_extra_params: bool = False,
    quantize: Callable[..., qarray.QArray] = qarray.quantize,
) -> Any:
    """Quantizes a float param tree (or any subtree of it) as the PTQ model would (each weight
    by ``quantize``: contrib.padded_ptq pads first).

    Args:
      params: pure dict of float arrays (Linen: unboxed params; NNX: nnx.to_pure_dict(...)),
        the whole tree or part of it with paths from the root.
      abstract_quantized_params: the PTQ model's params (Linen, possibly abstract and boxed) or the
        PTQ model itself (NNX, possibly abstract); it says how each weight is quantized.
      quant_stats: static-range statistics from QT or calibration (pure dict), for static scales.
      allow_extra_params: skip params that the PTQ model doesn't have instead of raising.

    Returns:
      The quantized tree with the structure of ``params`` (plus static scales): WithAux leaves for
      Linen, a pure dict for NNX (feed it to nnx.update).
    """
    out: dict[tuple[Any, ...], Any] = {}
    for path, param in flax.traverse_util.flatten_dict(params).items():
        if not isinstance(param, jax.Array):
            raise TypeError(f"params must be a pure dict of jax.Array; {path} is {type(param)}")
        abstract = get_value_from_path(abstract_quantized_params, path)
        if abstract is _MISSING:
            if allow_extra_params:
                continue
            raise ValueError(
                f"{'/'.join(map(str, path))} is not in the quantized model's params; pass "
                "allow_extra_params=True to skip such params."
            )
        if isinstance(abstract, WithAux) and isinstance(
            flax_util.unbox(abstract.array), qarray.QArray
        ):
            # The module may reshape the weight before its op; the PTQ param has the op's shape.
            param = WithAux(quantize(param.reshape(abstract.shape), abstract.how), abstract.how)
        out[path] = param
    for path, stat in _stats_by_op(quant_stats).items():
        _quantize_static_scale(out, abstract_quantized_params, path, stat)
    if isinstance(abstract_quantized_params, nnx.Module):
        out = {path: _pure(value) for path, value in out.items()}
    return flax.traverse_util.unflatten_dict(out)


def _stats_by_op(quant_stats: Any) -> dict[tuple[Any, ...], dict[str, Any]]:
    flat = flax.traverse_util.flatten_dict(flax_util.unbox(quant_stats))
    grouped: dict[tuple[Any, ...], dict[str, Any]] = {}
    for path, value in flat.items():
        grouped.setdefault(path[:-1], {})[path[-1]] = value
    return grouped


def _quantize_static_scale(out, abstract, path, stat) -> None:
    count = stat["count"]
    if not isinstance(count, jax.core.Tracer) and int(count) == 0:
        raise ValueError(f"quant_stats for {'/'.join(map(str, path))} hold no batches (count 0).")
    scale_path = (*path[:-1], f"{path[-1]}_scale")
    abstract_scale = get_value_from_path(abstract, scale_path)
    if not isinstance(abstract_scale, WithAux):
        raise ValueError(
            f"quant_stats has {'/'.join(map(str, path))} but the PTQ model has no static scale "
            f"{'/'.join(map(str, scale_path))}; do the rules match the QT rules?"
        )
    scale, zero_point = qarray.compute_scale_zero_point(
        averaging.calibration(stat), abstract_scale.how.qtype
    )
    out[scale_path] = WithAux(scale, abstract_scale.how)
    if zero_point is not None:
        out[(*path[:-1], f"{path[-1]}_zero_point")] = zero_point
