"""Calibration for weight-quantization algorithms that need the layer inputs (GPTQ and kin).

A CalibrationProvider runs the float model and, for every dot_general / einsum whose weight a
rule of its type matches, hands the op's input reshaped to (contracting features, samples) to
`_collect_stats`. SinglePassCalibrationProvider averages per-batch statistics (`compute_stats`)
into the "quant_stats" collection as `<weight><suffix>`, with the usual count / sum_of_* layout
(averaging.py), so statistics from several batches or runs merge.

`quantize_params_with_calibration` then quantizes every weight that has statistics with the
algorithm given, and the rest as PTQ does; the result feeds the PTQ model unchanged.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import flax
import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from qmill.engine.core import averaging, qarray
from qmill.engine.modeling import flax_util
from qmill.engine.modeling import rules as rules_lib
from qmill.engine.ops import einsum as einsum_lib
from qmill.engine.providers import base, model, ptq

_W = TypeVar("_W", bound=ptq.WithAux)


def _can_update(module: Any) -> bool:
    """Statistics are added while applying with quant_stats mutable, never while initializing."""
    if isinstance(module, nn.Module):
        return module.is_mutable_collection("quant_stats") and not module.is_initializing()
    return not model.is_initializing_nnx()


def _value(x: Any) -> Any:
    """An operand as an array: NNX models may hand a raw nnx.Param to jnp.einsum / dot_general."""
    return x.get_value() if isinstance(x, nnx.Variable) else x


class CalibrationProvider(base.QuantizationProvider, metaclass=abc.ABCMeta):
    """Runs the float ops; reports the inputs of weight ops matched by `get_rule_type()`."""

    @abc.abstractmethod
    def get_rule_type(self) -> type[rules_lib.QuantizationRule]:
        """The rule class this provider acts on (other rules are ignored)."""

    @abc.abstractmethod
    def get_stats_suffix(self) -> str:
        """Suffix of the statistic's name after the weight's (e.g. "_gptq")."""

    @abc.abstractmethod
    def _collect_stats(
        self,
        lhs: jax.Array,
        weight_name: str,
        *,
        module_path: tuple[str, ...],
        op_name: str,
        op_id: str | None,
        lhs_id: int,
        module: Any = None,
        weight: jax.Array | None = None,
        rule: rules_lib.QuantizationRule | None = None,
    ) -> None:
        """Records statistics of one op's input, reshaped to (contracting, samples).

        `module` is the module owning the weight, `weight` the op's weight operand reshaped to
        (contracting, rest), `rule` the matched rule: qmill's additions to the reference's
        signature (SmoothQuant needs the weight and the rule; both are known here).
        """

    def _observe(self, rule, op_name, op_id, module, lhs, rhs, dims) -> None:
        if not isinstance(rule, self.get_rule_type()):
            return
        (lc, rc), (lb, rb) = dims
        if lb or rb or len(lc) != 1 or len(rc) != 1:
            return  # one contracting axis, no batch axes: the setting of these methods
        name = flax_util.find_param(rhs, module)
        if name is None:
            return  # the right operand is not a weight
        x = jnp.moveaxis(jnp.asarray(lhs), lc[0], 0)
        w = jnp.moveaxis(jnp.asarray(rhs), rc[0], 0)
        self._collect_stats(
            x.reshape(x.shape[0], -1),
            str(name),
            module_path=flax_util.module_path(module),
            op_name=op_name,
            op_id=op_id,
            lhs_id=id(lhs),
            module=module,
            weight=w.reshape(w.shape[0], -1),
            rule=rule,
        )

    def dot_general(
        self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs
    ) -> jax.Array:
        lhs, rhs = _value(lhs), _value(rhs)
        out = jax.lax.dot_general(
            lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs
        )
        rule, op_id, module = self.current_rule_and_op_id("dot_general")
        self._observe(rule, "dot_general", op_id, module, lhs, rhs, dimension_numbers)
        return out

    def einsum(self, einsum_str, *operands, **kwargs) -> jax.Array:
        operands = tuple(_value(x) for x in operands)
        out = jnp.einsum(einsum_str, *operands, **kwargs)
        rule, op_id, module = self.current_rule_and_op_id("einsum")
        if isinstance(einsum_str, str) and len(operands) == 2:
            lhs, rhs = operands
            try:
                plan = einsum_lib._plan(einsum_str, tuple(lhs.shape), tuple(rhs.shape))
            except ValueError:
                return out  # an einsum quantized ops don't take: nothing to calibrate
            if not any(plan.squeeze) and plan.expand == (None, None):
                self._observe(rule, "einsum", op_id, module, lhs, rhs, plan.dimension_numbers)
        return out

    def get_intercept_map(self) -> dict[str, Callable[..., Any]]:
        return super().get_intercept_map() | {
            "jax.lax.dot_general": self.dot_general,
            "jax.numpy.einsum": self.einsum,
        }


class SinglePassCalibrationProvider(CalibrationProvider, metaclass=abc.ABCMeta):
    """Averages `compute_stats(input)` over batches into quant_stats `<weight><suffix>`."""

    @abc.abstractmethod
    def compute_stats(self, lhs: jax.Array) -> dict[str, jax.Array]:
        """Statistics of one batch's input (contracting, samples)."""

    def _collect_stats(self, lhs, weight_name, *, module=None, **_) -> None:
        self._accumulate(self.compute_stats(lhs), weight_name, module)

    def _accumulate(self, stats: dict[str, jax.Array], weight_name: str, module: Any) -> None:
        """Adds one batch's statistics to quant_stats `<weight_name><suffix>` of `module`."""
        stats = {k: v.astype(jnp.float32) for k, v in stats.items()}
        name = weight_name + self.get_stats_suffix()
        variable = flax_util.get_or_create_variable(
            "quant_stats", name, lambda: averaging.init(stats), module=module
        )
        if not _can_update(module):
            return
        if isinstance(variable, nnx.Variable):
            variable.set_value(averaging.update(variable.get_value(), stats))
        else:  # a Linen variable
            variable.value = averaging.update(variable.value, stats)


def normalize_weight(x: jax.Array, contraction_axis: int) -> tuple[jax.Array, Callable[[Any], Any]]:
    """A weight as (rows, columns) with its contracted axis last, and the inverse reshaping
    (taking an array or a QArray)."""
    moved = jnp.moveaxis(x, contraction_axis, -1)
    shape = moved.shape

    def restore(y: Any) -> Any:
        y = y.reshape(shape)
        if isinstance(y, qarray.QArray):
            return jax.tree.map(lambda p: jnp.moveaxis(p, -1, contraction_axis), y)
        return jnp.moveaxis(y, -1, contraction_axis)

    return moved.reshape(-1, shape[-1]), restore


@dataclasses.dataclass(frozen=True)
class CalibratedQuantContext:
    """One weight to quantize with its statistics.

    weight: (rows, columns), the contracted axis last; how: its HowToQuantize for that layout
    (rows channelwise, columns tiled as the PTQ model tiles the contracted axis);
    calibration_stats: the averaged statistics; abs_w: the PTQ model's WithAux for it;
    restore_shape: back to the parameter's layout; path: the parameter's path.
    """

    weight: jax.Array
    how: qarray.HowToQuantize
    calibration_stats: dict[str, jax.Array]
    abs_w: ptq.WithAux
    contracting_axis: int
    restore_shape: Callable[[Any], Any]
    path: tuple[Any, ...]

    def channel_stat(self, name: str, method: str) -> jax.Array:
        """The statistic `name` of `method` (AWQ, SmoothQuant): one value per input channel.

        Raises:
            ValueError: it does not have one value per column of the weight.
        """
        stat = self.calibration_stats[name]
        if stat.shape != (self.weight.shape[1],):
            raise ValueError(
                f"{'/'.join(map(str, self.path))}: {method} statistics of shape {stat.shape} do "
                f"not match the weight's {self.weight.shape[1]} input channels"
            )
        return stat

    def with_scale(self, kind: type[_W], q: qarray.QArray, **scale: jax.Array) -> _W:
        """`q` (quantized in this context's layout) back in the parameter's, as a WithAux of
        `kind` carrying its per-channel `scale` (AWQ's WithAwqScale, SmoothQuant's WithSqScale)."""
        return kind(
            array=self.restore_shape(q),
            contracting_axis=self.contracting_axis,
            how=self.abs_w.how,
            **scale,
        )


def extract_calibrated_quant_context(
    path: tuple[Any, ...], weight: jax.Array, abs_w: ptq.WithAux, stats: Any
) -> CalibratedQuantContext | None:
    """The context for one weight, or None where it has not exactly one contracted axis (the
    contracted axis is the one axis the PTQ model does not quantize channelwise)."""
    w, abstract = weight, abs_w
    contracting = set(range(w.ndim)) - set(abstract.how.channelwise_axes)
    if len(contracting) != 1:
        return None  # not one contracted axis: PTQ it
    axis = contracting.pop()
    normalized, restore = normalize_weight(w, axis)
    tile = abstract.how.tiled_axes_dict.get(axis)
    how = dataclasses.replace(
        abstract.how, channelwise_axes=(0,), tiled_axes={1: tile} if tile else {}
    )
    calibration = averaging.calibration(flax_util.unbox(stats))
    return CalibratedQuantContext(normalized, how, calibration, abstract, axis, restore, path)


def quantize_params_with_calibration(
    params: Any,
    abstract_quantized_params: Any,
    quant_stats: Any,
    stats_suffix: str,
    quantize_fn: Callable[[CalibratedQuantContext], Any],
    *,
    allow_extra_params: bool = False,
    pure_nnx: bool = True,
) -> Any:
    """Quantizes weights with statistics `<name><stats_suffix>` by `quantize_fn` (which returns
    the param's WithAux), and every other param as ptq.quantize_params does.

    For an NNX model the results are pure dicts (for nnx.update) unless `pure_nnx` is False
    (SmoothQuant keeps its WithSqScale objects there, as the reference does).
    """
    done: dict[tuple[Any, ...], Any] = {}
    rest: dict[tuple[Any, ...], Any] = {}
    stats_tree = flax_util.unbox(quant_stats)
    for path, w in flax.traverse_util.flatten_dict(params).items():
        abstract = ptq.get_value_from_path(abstract_quantized_params, path)
        stats = ptq.get_value_from_path(stats_tree, (*path[:-1], f"{path[-1]}{stats_suffix}"))
        ctx = None
        if isinstance(abstract, ptq.WithAux) and isinstance(stats, dict | flax.core.FrozenDict):
            ctx = extract_calibrated_quant_context(path, w, abstract, stats)
        if ctx is None:
            rest[path] = w
            continue
        result = quantize_fn(ctx)
        if pure_nnx and isinstance(abstract_quantized_params, nnx.Module):
            result = pure(result)  # the layout ptq.quantize_params gives NNX
        done[path] = result
    others = ptq.quantize_params(
        flax.traverse_util.unflatten_dict(rest) if rest else {},
        abstract_quantized_params,
        allow_extra_params=allow_extra_params,
    )
    done.update(flax.traverse_util.flatten_dict(others, is_leaf=_is_quantized_leaf))
    return flax.traverse_util.unflatten_dict(done)


def pure(x: Any) -> Any:
    """A quantized param as the nested dict nnx.to_pure_dict gives for it: every array field of
    a WithAux (subclasses add theirs, e.g. awq_scale) and of its QArray."""
    if isinstance(x, ptq.WithAux):
        out = {"array": pure(x.array)}
        for field in dataclasses.fields(x):
            if field.name not in ("array", "how") and field.metadata.get("pytree_node", True):
                out[field.name] = getattr(x, field.name)
        return out
    return ptq._pure(x)


def _is_quantized_leaf(_: Any, value: Any) -> bool:
    return isinstance(value, ptq.WithAux)
