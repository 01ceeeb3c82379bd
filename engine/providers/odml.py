"""ODML (LiteRT) modes: QAT for edge targets, and the conversion mode that exports qmill's scales
(its provider in odml_conversion.py; the ops both share here).

Lingo:
  fake quant      x -> dequantize(quantize(x)) with a given scale (and zero point).
  composite       a StableHLO op wrapping a decomposition; here every fake quant of the conversion
                  model is a composite named ``quant.fake_quant`` whose attributes carry the scale,
                  zero point, storage dtype ("i8", "i4", "i16"), narrow_range and the per-channel
                  axis (``quantization_dimension``, -1 per tensor). The LiteRT converter in strict
                  QDQ mode turns each one into a quantized tensor with exactly those parameters.
  model output    LiteRT kernels are integer end to end only when the graph's output is quantized
                  too; its static range is the statistic ``final_output0`` at the top of
                  quant_stats (the reference's name), which OdmlQatProvider records.
  statistics      named as the reference's (odml_names.py): jnp.dot is the op ``dot``, and ops
                  reading one activation under one rule share the first one's fake quant and
                  statistic. ``stat_aliases`` says which statistic serves each op a PtqProvider
                  model looks up (quantize_params: pass ``odml_names.ptq_stats(...)``).

What LiteRT can store, and so what these providers accept: one scale per tensor or per channel
along one axis (no sub-channel tiles), symmetric weights, per-tensor activations with static
scales. Anything else raises ``LiteRtUnsupported`` naming the rule to change.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.core import qarray, qtypes
from qmill.engine.modeling import flax_util
from qmill.engine.modeling import rules as rules_mod
from qmill.engine.providers import odml_boundary as boundary
from qmill.engine.providers import odml_names as names
from qmill.engine.providers import qt

COMPOSITE_NAME = "quant.fake_quant"
MODEL_OUTPUT = boundary.MODEL_OUTPUT
MODEL_INPUT = boundary.MODEL_INPUT
# qmill qtype -> the converter's storage dtype name.
_LITERT_DTYPES = {"int8": "i8", "int4": "i4", "int16": "i16"}
# Views a weight may reach its op through: a reshape keeps the per-channel scales meaningful.
_WEIGHT_VIEWS = frozenset({"reshape", "squeeze", "astype"})


class LiteRtUnsupported(ValueError):
    """A rule asks for a quantization that a LiteRT model cannot store."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FakeQuantRecord:
    """One fake quant of an exported model, as the converter receives it."""

    # '/'-joined module path and param or activation name ("Dense_0/kernel", "Conv_1/..._lhs").
    name: str
    # "weight", "activation", "input" (a model input) or "output".
    kind: str
    qtype: str
    # One entry per channel along quantization_dimension, or one entry per tensor.
    scale: np.ndarray
    # Per tensor; None when symmetric.
    zero_point: int | None
    # The per-channel axis of the float tensor; -1 per tensor.
    quantization_dimension: int
    # Weights: qmill's integer values (int8 numpy), in the weight's layout; None for activations.
    qvalue: np.ndarray | None = None


def litert_dtype(qtype: Any) -> str:
    """The converter's dtype name for a qtype LiteRT stores, else LiteRtUnsupported."""
    name = qtypes.name(qtype)
    if name not in _LITERT_DTYPES:
        raise LiteRtUnsupported(
            f"LiteRT models store {', '.join(_LITERT_DTYPES)} tensors, not {name}; change the "
            "rule's qtype."
        )
    return _LITERT_DTYPES[name]


def _broadcast_shape(ndim: int, axis: int) -> tuple[int, ...]:
    return tuple(-1 if a == axis else 1 for a in range(ndim))


def fake_quant_composite(
    x: jax.Array,
    *,
    qtype: Any,
    scale: np.ndarray,
    zero_point: int | None = None,
    quantization_dimension: int = -1,
) -> jax.Array:
    """x fake-quantized with qmill's numerics, wrapped in a ``quant.fake_quant`` composite."""
    qt_name = qtypes.name(qtype)
    storage = qtypes.get(qt_name).storage

    def decomposition(x, *, scale, dtype, narrow_range, quantization_dimension, zero_point=None):
        del dtype, narrow_range  # attributes for the converter; qt_name says the same
        per_channel = scale.size > 1
        shape = _broadcast_shape(x.ndim, int(quantization_dimension)) if per_channel else None
        s = jnp.asarray(scale, x.dtype).reshape(shape or (1,) * x.ndim)
        zp = None if zero_point is None else jnp.full(s.shape, zero_point, storage)
        q = qarray.quantize_with_scale_zero_point(x, qt_name, s.astype(x.dtype), zp)
        return qarray.dequantize(q).astype(x.dtype)

    return jax.lax.composite(decomposition, COMPOSITE_NAME)(
        x,
        scale=np.asarray(scale, np.float32).reshape(-1),
        zero_point=None if zero_point is None else np.int64(zero_point),
        dtype=litert_dtype(qt_name),
        # qmill's symmetric int bound is qmax + 0.5, so -128 (-8 for int4) is used: full range.
        narrow_range=False,
        quantization_dimension=np.int64(quantization_dimension),
    )


def weight_axis(how: qarray.HowToQuantize, shape: Sequence[int], where: str) -> int:
    """The one per-channel axis of a weight quantized as ``how`` (-1: per tensor)."""
    if how.tiled_axes:
        raise LiteRtUnsupported(
            f"{where}: LiteRT stores one scale per channel, not per tile; remove tile_size from "
            "the rule."
        )
    axes = [a for a in how.channelwise_axes if shape[a] > 1]
    if len(axes) > 1:
        raise LiteRtUnsupported(
            f"{where}: the weight has scales along axes {axes}; LiteRT stores them along one axis "
            "only. Exclude this module from the rules."
        )
    return axes[0] if axes else (how.channelwise_axes[0] if how.channelwise_axes else -1)


def _per_tensor(how: qarray.HowToQuantize) -> qarray.HowToQuantize:
    return dataclasses.replace(how, channelwise_axes=())


def _check_static(rule: rules_mod.QuantizationRule, where: str) -> None:
    if not rule.resolved_act_static_scale:
        raise LiteRtUnsupported(
            f"{where}: LiteRT integer kernels need static activation scales; set "
            "act_static_scale=True (and calibrate), or drop act_qtype for weight-only."
        )


class _OdmlOps(qt.QtProvider):
    """What both ODML providers share: the reference's op names (jnp.dot is ``dot``) and the
    sharing of one fake quant among sibling ops within a model call."""

    def __init__(self, rules: Sequence[rules_mod.QuantizationRule] | None) -> None:
        super().__init__(boundary.odml_rules(rules))
        self._shared = names.SharedInputs()
        # PTQ statistic path -> the path of the statistic that holds its range, for every op
        # input with a static range seen so far (see odml_names.ptq_stats).
        self.stat_aliases: dict[str, str] = {}

    def numpy_dot(self, a, b, precision=None, preferred_element_type=None, **kwargs):
        """jnp.dot: the op ``dot`` (its own rule lookup and numbering), as the reference's ODML
        providers name it. Matmuls (``x @ w``) stay dot_generals, as there."""
        if a.ndim == 0 or b.ndim == 0:
            return jnp.dot(a, b, precision=precision, preferred_element_type=None, **kwargs)
        rhs_contract = 0 if b.ndim == 1 else b.ndim - 2
        dn = (((a.ndim - 1,), (rhs_contract,)), ((), ()))
        return self.named_dot_general("dot", a, b, dn, precision, preferred_element_type)

    def get_intercept_map(self) -> dict[str, Any]:
        return super().get_intercept_map() | {"jax.numpy.dot": self.numpy_dot}

    def current_rule_and_op_id(self, op_name: str) -> tuple[Any, Any, Any]:
        rule, op_id, module = super().current_rule_and_op_id(op_name)
        return rule, names.with_ptq_id(op_name, op_id, module), module

    def shared_act(self, module, x, rule, how, op_id, side, make) -> jax.Array:
        """make()'s fake quant of the activation x, or a sibling's made earlier in this call
        under the same rule and how; records which statistic serves this op's PTQ name."""
        stat = None
        if op_id is not None and module is not None and rule.resolved_act_static_scale:
            stat = names.join(module, f"{op_id}_{side}")
        fq, used = self._shared.get_or_make(x, (rule, how), stat, make)
        if used is not None:
            self.stat_aliases[names.join(module, f"{names.ptq_id(op_id)}_{side}")] = used
        return fq


class OdmlQatProvider(_OdmlOps):
    """Quantization-aware training (and calibration) for models exported to LiteRT.

    Compared with QtProvider: only what LiteRT stores is accepted (per-channel or per-tensor
    weights, static-range per-tensor activations), and the model output is fake-quantized with its
    own static statistic (``model_output``), so the exported model is integer end to end.
    """

    def __init__(
        self,
        rules: Sequence[rules_mod.QuantizationRule] | None = None,
        *,
        disable_per_channel_weights: bool = False,
        fixed_range_for_inputs: tuple[float, float] | None = None,
        fixed_range_for_outputs: tuple[float, float] | None = None,
        strict: bool = True,
    ) -> None:
        super().__init__(rules)
        # Known ranges of the model's inputs / outputs (e.g. (0, 1) for images): their fake quant
        # uses "fixed,lo,hi" instead of calibrated statistics.
        self._input_range = boundary.fixed_method(fixed_range_for_inputs, "fixed_range_for_inputs")
        self._output_range = boundary.fixed_method(
            fixed_range_for_outputs, "fixed_range_for_outputs"
        )
        # One scale per weight tensor instead of one per output channel.
        self._per_tensor_weights = disable_per_channel_weights
        # Raise on rules LiteRT can't store (else they are trained as asked, export will refuse).
        self._strict = strict

    def get_interceptors(self) -> list[Any]:
        """Two layers, as the reference's: structural (views), then numerical (ops)."""
        return boundary.layered_interceptors(self)

    def _run(self, rule, op_id, module, lhs, rhs, how, compute) -> jax.Array:
        where = "/".join(flax_util.module_path(module)) + f" {op_id}"
        operands = []
        for side, x in (("lhs", lhs), ("rhs", rhs)):
            for_lhs = side == "lhs"
            if flax_util.find_param(x, module) is not None:
                h = how.weight(for_lhs)
                h = _per_tensor(h) if self._per_tensor_weights else h
                if self._strict:
                    litert_dtype(h.qtype)
                    weight_axis(h, x.shape, where)
                x = qt.ste(x, qt.fake_quant(x, h))
            elif rule.act_qtype is not None:
                if self._strict:
                    litert_dtype(rule.act_qtype)
                    _check_static(rule, where)
                h = how.act(for_lhs)
                name = None if op_id is None else f"{op_id}_{side}"
                x = self.shared_act(
                    module,
                    x,
                    rule,
                    h,
                    op_id,
                    side,
                    lambda x=x, h=h, name=name: qt.ste(
                        x, self.fake_quant_act(module, x, h, rule, name)
                    ),
                )
            operands.append(x)
        return compute(*operands)

    def model_output(self, module: Any, out: Any, method_name: str = "__call__") -> Any:
        """Hook of quantize_model: fake-quantizes the model output with its running statistic
        (``final_output<i>``; ``<method>_output<i>`` for another method)."""
        self._shared.reset()

        def fake_quant(rule: rules_mod.QuantizationRule, name: str, y: Any) -> Any:
            if not (isinstance(y, jax.Array) and jnp.issubdtype(y.dtype, jnp.floating)):
                return y
            how, rule = boundary.boundary_how(rule, self._output_range)
            with boundary.variables_allowed(module):
                fq = self.fake_quant_act(module, y, how, rule, name)
            return qt.ste(y, fq)

        return boundary.map_outputs(self.rules, module, out, fake_quant, method_name)

    def process_model_inputs(self, model: Any, model_args: Any, model_kwargs: Any) -> Any:
        """With fixed_range_for_inputs: fake-quantizes the model's float inputs with that range,
        recording it as the statistic ``model_input`` (``model_input_<i>``) for the export."""
        self._shared.reset()
        if self._input_range is None:
            return model, model_args, model_kwargs

        def fake_quant(rule: rules_mod.QuantizationRule, name: str, y: Any) -> Any:
            how, rule = boundary.boundary_how(rule, self._input_range)
            with boundary.variables_allowed(model):
                return qt.ste(y, self.fake_quant_act(model, y, how, rule, name))

        args, kwargs = boundary.map_inputs(
            self.rules, model, (model_args, model_kwargs), fake_quant
        )
        return model, args, kwargs
