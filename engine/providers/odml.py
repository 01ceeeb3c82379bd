"""ODML (LiteRT) modes: QAT for edge targets, and the conversion mode that exports qmill's scales.

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
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.core import averaging, qarray, qtypes
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


class OdmlConversionProvider(_OdmlOps):
    """The model as LiteRT will run it: every fake quant is a ``quant.fake_quant`` composite.

    Scales are computed eagerly (in numpy terms) from ``params`` with qmill's own quantization,
    and, for static-range activations, from ``quant_stats``; the composites carry them to the
    converter. Export the model with its params closed over (constants), e.g.
    ``jax.export.export(jax.jit(lambda x: model.apply({"params": params}, x)))``.

    Supported: weight-only quantization and static-range quantization.
    """

    def __init__(
        self,
        rules: Sequence[rules_mod.QuantizationRule] | None = None,
        params: Any = None,
        quant_stats: Any = None,
        *,
        disable_per_channel_weights: bool = False,
    ) -> None:
        super().__init__(rules)
        # Float params (pure dict); weights are looked up here when the model sees tracers.
        self._params = flax_util.unbox(params) if params is not None else {}
        # Static-range statistics (pure dict, as QT / OdmlQatProvider collect them).
        self._stats = flax_util.unbox(quant_stats) if quant_stats is not None else {}
        self._per_tensor_weights = disable_per_channel_weights
        # Every fake quant of the last trace, by name (the export's info and tests read them).
        self.records: dict[str, FakeQuantRecord] = {}

    # ---- ops --------------------------------------------------------------------------------

    def get_interceptors(self) -> list[Any]:
        """Two layers, as the reference's: structural (views), then numerical (ops)."""
        return boundary.layered_interceptors(self)

    def _run(self, rule, op_id, module, lhs, rhs, how, compute) -> jax.Array:
        path = "/".join(flax_util.module_path(module))
        operands = []
        for side, x in (("lhs", lhs), ("rhs", rhs)):
            for_lhs = side == "lhs"
            ref = flax_util.find_param(x, module)
            if ref is not None:
                x = self._weight(module, ref, x, how.weight(for_lhs), _join(path, ref.name))
            elif rule.act_qtype is not None:
                name = _join(path, f"{op_id}_{side}")
                _check_static(rule, name)
                x = self.shared_act(
                    module,
                    x,
                    rule,
                    how.act(for_lhs),
                    op_id,
                    side,
                    lambda x=x, name=name, side=side: self._activation(
                        x, rule, self._stat(module, f"{op_id}_{side}", op_id=op_id, side=side), name
                    ),
                )
            operands.append(x)
        return compute(*operands)

    def model_output(self, module: Any, out: Any, method_name: str = "__call__") -> Any:
        """Hook of quantize_model: the output's composite, when quant_stats has its statistic."""
        self._shared.reset()

        def composite(rule: rules_mod.QuantizationRule, name: str, y: Any) -> Any:
            stat = self._stat(module, name, required=False)
            if stat is None or not jnp.issubdtype(y.dtype, jnp.floating):
                return y
            return self._activation(y, rule, stat, name, kind="output")

        return boundary.map_outputs(self.rules, module, out, composite, method_name)

    def process_model_inputs(self, model: Any, model_args: Any, model_kwargs: Any) -> Any:
        """The model inputs' composites, where quant_stats has their statistic (see QAT)."""
        self._shared.reset()

        def composite(rule: rules_mod.QuantizationRule, name: str, y: Any) -> Any:
            stat = self._stat(model, name, required=False)
            return y if stat is None else self._activation(y, rule, stat, name, kind="input")

        args, kwargs = boundary.map_inputs(self.rules, model, (model_args, model_kwargs), composite)
        return model, args, kwargs

    # ---- weights and activations ----------------------------------------------------------

    def _weight(self, module, ref, x, how, name) -> jax.Array:
        bad = [v for v in ref.views if v not in _WEIGHT_VIEWS]
        if bad:
            raise LiteRtUnsupported(
                f"{name} reaches its op through {bad}; store the weight in the layout its op "
                "uses, or exclude the module from the rules."
            )
        how = _per_tensor(how) if self._per_tensor_weights else how
        axis = weight_axis(how, x.shape, name)
        litert_dtype(how.qtype)
        value = self._concrete_weight(module, ref, x, name)
        with jax.ensure_compile_time_eval():
            qa = qarray.quantize(jnp.asarray(value, np.float32), how)
            if qa.zero_point is not None:
                raise LiteRtUnsupported(
                    f"{name}: LiteRT weights are symmetric; use an absmax weight calibration."
                )
            # The composite's input is qmill's dequantized weight: the converter's
            # round(w / scale) then gives back qmill's integer values exactly.
            dequantized = np.asarray(qarray.dequantize(qa), np.float32)
            scale = np.asarray(qa.scale, np.float32).reshape(-1)
            qvalue = np.asarray(qa.qvalue).astype(np.int8)
        self.records[name] = FakeQuantRecord(
            name=name,
            kind="weight",
            qtype=how.qtype,
            scale=scale,
            zero_point=None,
            quantization_dimension=axis,
            qvalue=qvalue,
        )
        return fake_quant_composite(
            jnp.asarray(dequantized, x.dtype),
            qtype=how.qtype,
            scale=scale,
            quantization_dimension=axis,
        )

    def _concrete_weight(self, module, ref, x, name) -> np.ndarray:
        stored = _lookup(self._params, (*flax_util.module_path(module), ref.name))
        if stored is not None:
            return np.asarray(stored).reshape(x.shape)
        if isinstance(x, jax.core.Tracer):
            raise ValueError(
                f"{name} is traced and not in the params given to OdmlConversionProvider; pass "
                "the model's float params to the provider."
            )
        return np.asarray(x)

    def _stat(
        self, module, name, *, required=True, op_id=None, side=None
    ) -> Mapping[str, Any] | None:
        path = (*flax_util.module_path(module), name)
        stat = _lookup(self._stats, path)
        for legacy in names.legacy_names(name, op_id, side) if stat is None else ():
            # A calibration made before qmill followed the reference's names.
            stat = _lookup(self._stats, (*path[:-1], legacy))
            if stat is not None:
                break
        if stat is None and required:
            raise ValueError(
                f"no quant_stats for {'/'.join(path)}: static-range export needs statistics "
                "from a calibration with the same rules."
            )
        if stat is not None and int(stat["count"]) == 0:
            raise ValueError(f"quant_stats for {'/'.join(path)} hold no batches (count 0).")
        return stat

    def _activation(self, x, rule, stat, name, kind="activation") -> jax.Array:
        litert_dtype(rule.act_qtype)
        with jax.ensure_compile_time_eval():
            axes = tuple(rule.act_batch_axes)
            calibration = {
                k: jnp.mean(jnp.asarray(v), axis=axes, keepdims=True)
                for k, v in averaging.calibration(stat).items()
            }
            scale, zero_point = qarray.compute_scale_zero_point(calibration, rule.act_qtype)
            scale = np.asarray(scale, np.float32).reshape(-1)
            zp = None if zero_point is None else np.asarray(zero_point).reshape(-1)
        if scale.size != 1:
            raise LiteRtUnsupported(
                f"{name}: the statistics give {scale.size} activation scales; LiteRT stores one "
                "per activation tensor. Set act_batch_axes to every axis but the channel one "
                "(calibrate with --rules w8a8-static-seq for (batch, sequence, features) inputs)."
            )
        zp_int = None if zp is None else int(zp[0])
        self.records[name] = FakeQuantRecord(
            name=name,
            kind=kind,
            qtype=qtypes.name(rule.act_qtype),
            scale=scale,
            zero_point=zp_int,
            quantization_dimension=-1,
        )
        return fake_quant_composite(x, qtype=rule.act_qtype, scale=scale, zero_point=zp_int)


def _join(path: str, name: str) -> str:
    return f"{path}/{name}" if path else name


def _lookup(tree: Any, path: Sequence[str]) -> Any:
    for key in path:
        if not isinstance(tree, Mapping) or key not in tree:
            return None
        tree = tree[key]
    return tree
