"""Quantized training (QT): quantized forward and backward passes, as the reference's.

dot_general, einsum and conv_general_dilated run as the QT ops (qt_ops: ops.dot_general_qt /
conv_general_qt): the operands are quantized and multiplied as codes (int8 × int8 → int32), and
with ``bwd_qtype`` each operand's gradient is an integer product too, of the quantized output
gradient and the other operand's codes. Without ``bwd_qtype`` the gradients are the float
products of g and the operands as given. Ops without a QT op (ragged_dot) fake-quantize their
operands for the float op (qt_fake).

Static-range activations keep additive statistics (averaging.py) in the ``quant_stats`` collection
(Linen) or ``QuantStat`` variables (NNX), named ``<op_id>_{lhs,rhs}``; quantize_params and the
NNX PtqProvider turn them into static scales.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from qmill.engine.core import averaging, numerics_api, qarray, sparsity
from qmill.engine.modeling import flax_util
from qmill.engine.ops import dot_general_qt, op_adapter
from qmill.engine.providers import base, model, qt_fake, qt_ops
from qmill.engine.providers.qt_fake import qt_option as qt_option
from qmill.engine.providers.qt_fake import stochastic_noise_fn as stochastic_noise_fn


def fake_quant(x: jax.Array, how: qarray.HowToQuantize) -> jax.Array:
    """x quantized and dequantized as ``how`` says, in x's dtype (no gradient)."""
    return qarray.dequantize(qarray.quantize(jax.lax.stop_gradient(x), how)).astype(x.dtype)


def ste(x: jax.Array, fq: jax.Array) -> jax.Array:
    """fq in the forward pass, x's gradient in the backward (the straight-through estimator)."""
    return x + jax.lax.stop_gradient(fq - x)


def clipped_ste(
    x: jax.Array, fq: jax.Array, how: qarray.HowToQuantize, calibration=None
) -> jax.Array:
    """ste, with the gradient zeroed where x fell outside the range its calibration kept (as the
    reference clips gradients; absmax / minmax keep everything, so nothing is masked).
    ``calibration``: the one x was quantized with (None: x's own)."""
    if qarray.is_gradient_clipping_noop(how.calibration_method):
        return ste(x, fq)
    x0 = jax.lax.stop_gradient(x)
    if calibration is None:
        calibration = qarray.calibrate(x0, how)
    masked = qarray.clip_gradient_to_calibration(x - x0, x0, calibration, how.calibration_method)
    return ste(x0 + masked, fq)


class QtProvider(base.OpsProvider):
    """Fake-quantized forward (and optionally backward) for quantization-aware training.

    ``QtProvider(rules)`` or ``QtProvider(rules=rules)``.
    """

    def dot_general(
        self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs
    ) -> jax.Array:
        return self.named_dot_general(
            "dot_general", lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs
        )

    def named_dot_general(
        self, op_name, lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs
    ) -> jax.Array:
        """dot_general, its rule and op id looked up as ``op_name`` (the ODML providers name
        jnp.dot "dot", as the reference's)."""

        def compute(a, b):
            return jax.lax.dot_general(a, b, dimension_numbers, precision, preferred_element_type)

        rule, op_id, module = self.current_rule_and_op_id(op_name)
        if rule is None or rule.weight_qtype is None:
            return jax.lax.dot_general(
                lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs
            )
        how = op_adapter.dot_general_how(rule, lhs, rhs, dimension_numbers)
        layout = op_adapter.dot_general_grad_layout(dimension_numbers, (lhs.ndim, rhs.ndim))
        qt_op = qt_ops.dot_general_op(dimension_numbers, preferred_element_type)
        return self._run(rule, op_id, module, lhs, rhs, how, _Op(compute, layout, qt_op))

    def einsum(self, einsum_str, *operands, **kwargs) -> jax.Array:
        rule, op_id, module = self.current_rule_and_op_id("einsum")
        if rule is None or rule.weight_qtype is None or len(operands) != 2:
            return jnp.einsum(einsum_str, *operands, **kwargs)
        lhs, rhs = operands
        how = op_adapter.einsum_how(rule, lhs, rhs, einsum_str)
        kwargs.pop("_dot_general", None)
        compute = lambda a, b: jnp.einsum(einsum_str, a, b, **kwargs)  # noqa: E731
        layout = op_adapter.einsum_grad_layout(einsum_str)
        pet = kwargs.get("preferred_element_type")
        qt_op = qt_ops.einsum_op(einsum_str, lhs.shape, rhs.shape, pet)
        return self._run(rule, op_id, module, lhs, rhs, how, _Op(compute, layout, qt_op))

    def conv_general_dilated(self, lhs, rhs, window_strides, padding, *args, **kwargs):
        def compute(a, b):
            return jax.lax.conv_general_dilated(a, b, window_strides, padding, *args, **kwargs)

        rule, op_id, module = self.current_rule_and_op_id("conv_general_dilated")
        if rule is None or rule.weight_qtype is None:
            return compute(lhs, rhs)
        dn_arg = kwargs.get("dimension_numbers", args[2] if len(args) > 2 else None)
        dn = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, dn_arg)
        how, layout = op_adapter.conv_how(rule, dn), op_adapter.conv_grad_layout(dn)
        qt_op = qt_ops.conv_op(window_strides, padding, *args, **kwargs)
        return self._run(rule, op_id, module, lhs, rhs, how, _Op(compute, layout, qt_op))

    def ragged_dot(
        self,
        lhs,
        rhs,
        group_sizes,
        precision=None,
        preferred_element_type=None,
        group_offset=None,
        **kwargs,
    ) -> jax.Array:
        """QT jax.lax.ragged_dot (lhs [m, k] activation, rhs [groups, k, n] weight)."""

        def compute(a, b):
            extra = kwargs if group_offset is None else kwargs | {"group_offset": group_offset}
            return jax.lax.ragged_dot(a, b, group_sizes, precision, preferred_element_type, **extra)

        rule, op_id, module = self.current_rule_and_op_id("ragged_dot")
        if rule is None or rule.weight_qtype is None:
            return compute(lhs, rhs)
        how = op_adapter.ragged_dot_how(rule)
        layout = op_adapter.RAGGED_DOT_GRAD_LAYOUT
        return self._run(rule, op_id, module, lhs, rhs, how, _Op(compute, layout))

    # ---- the quantized op ---------------------------------------------------------------------

    def _run(self, rule, op_id, module, lhs, rhs, how, compute) -> jax.Array:
        sparsity_rule = qt_option(rule, "sparsity_rule", None)
        if sparsity_rule is not None:
            # The rhs, before quantization, as the reference: the kept values get the range.
            rhs = sparsity.sparsify(rhs, sparsity_rule)
        weights = tuple(flax_util.find_param(x, module) is not None for x in (lhs, rhs))
        if compute.qt is None:
            return self._run_fake_quant(rule, op_id, module, (lhs, rhs), weights, how, compute)
        noise = qt_ops.noise_fn(rule, _rounding_key(module), lhs, rhs)
        config = qt_ops.config_for(rule, compute.qt, weights, noise)
        calibrations = []
        for side, x, is_weight in zip(("lhs", "rhs"), (lhs, rhs), weights, strict=True):
            qtype = getattr(config, f"{side}_qtype")
            if qtype is None or not numerics_api.should_quantize(x.dtype):
                calibrations.append(None)
                continue
            method = getattr(config, f"{side}_calibration_method")
            h = how(for_lhs=side == "lhs", qtype=qtype, calibration_method=method)
            per_tensor = getattr(config, f"{side}_disable_channelwise_axes")
            h = dot_general_qt.per_tensor_if(h, per_tensor)
            name = None if is_weight or op_id is None else f"{op_id}_{side}"
            calibration = self.act_calibration(module, x, h, rule, name)
            if calibration is None:
                calibration = qarray.calibrate(jax.lax.stop_gradient(x), h)
            calibrations.append(calibration)
        return compute.qt.run(lhs, rhs, *calibrations, config)

    def _run_fake_quant(self, rule, op_id, module, operands, weights, how, compute) -> jax.Array:
        """The float op on fake-quantized operands (see qt_fake)."""
        clip = not qt_option(rule, "disable_gradient_clipping", False)
        out = []
        for side, x, is_weight in zip(("lhs", "rhs"), operands, weights, strict=True):
            for_lhs = side == "lhs"
            if is_weight:
                h = self._maybe_per_tensor(rule, how.weight(for_lhs))
                calibration = None
            elif rule.act_qtype is not None:
                h = self._maybe_per_tensor(rule, how.act(for_lhs))
                name = None if op_id is None else f"{op_id}_{side}"
                calibration = self.act_calibration(module, x, h, rule, name)
            else:
                out.append(x)
                continue
            fq = _quantize_with(x, h, calibration)
            out.append(clipped_ste(x, fq, h, calibration) if clip else ste(x, fq))
        if qt_ops.setting(rule, "bwd_qtype") is None:
            return compute(*out)
        weight_side = "lhs" if weights[0] else "rhs" if weights[1] else None
        cfg = qt_fake.BwdConfig.of(rule, compute.grad_layout, weight_side)
        return qt_fake.with_quantized_grad(compute, cfg, qt_fake.rounding_key(module, cfg), *out)

    def _maybe_per_tensor(self, rule, how: qarray.HowToQuantize) -> qarray.HowToQuantize:
        return dot_general_qt.per_tensor_if(how, qt_ops.setting(rule, "disable_channelwise_axes"))

    def fake_quant_act(self, module, x, how, rule, act_name) -> jax.Array:
        """Fake-quantizes an activation; static scales come from the running statistic."""
        return _quantize_with(x, how, self.act_calibration(module, x, how, rule, act_name))

    def act_calibration(self, module, x, how, rule, act_name) -> dict[str, jax.Array] | None:
        """The calibration an activation is quantized with: the running statistic's for static
        scales (updated when the model may), None (x's own, dynamic) otherwise."""
        if not rule.resolved_act_static_scale or module is None or act_name is None:
            return None
        axes = tuple(rule.act_batch_axes)
        current = {
            k: v.mean(axis=axes, keepdims=True)
            for k, v in qarray.calibrate(jax.lax.stop_gradient(x), how).items()
        }
        stat = _get_or_init_stat(module, act_name, current)
        if _can_update(module):
            stat = averaging.update(stat, current)
            _set_stat(module, act_name, stat)
            return averaging.calibration(stat)
        seen = stat["count"] > 0
        avg = averaging.calibration(stat)
        return {k: jnp.where(seen, avg[k], v.astype(jnp.float32)) for k, v in current.items()}


def _quantize_with(x: jax.Array, how: qarray.HowToQuantize, calibration) -> jax.Array:
    """x fake-quantized (no gradient) as ``how`` says, with ``calibration`` when given (a static
    scale) and x's own otherwise."""
    if calibration is None:
        return fake_quant(x, how)
    scale, zero_point = qarray.compute_scale_zero_point(calibration, how.qtype)
    q = qarray.quantize_with_scale_zero_point(
        jax.lax.stop_gradient(x), how.qtype, scale.astype(x.dtype), zero_point
    )
    return qarray.dequantize(q).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class _Op:
    """The float op on two operands, with the layout of its output gradient and the QT op that
    runs it quantized (None: fake-quantized, see qt_fake).

    Subclasses overriding ``_run`` just call it (the float op).
    """

    fn: Callable[[jax.Array, jax.Array], jax.Array]
    grad_layout: op_adapter.GradLayout | None
    qt: qt_ops.QtOp | None = None

    def __call__(self, a: jax.Array, b: jax.Array) -> jax.Array:
        return self.fn(a, b)


def _can_update(module: Any) -> bool:
    if isinstance(module, nn.Module):
        return module.is_mutable_collection("quant_stats") and not module.is_initializing()
    return not model.is_initializing_nnx() and not getattr(
        module, "disable_quant_stats_update", False
    )


def _get_or_init_stat(module: Any, name: str, calibration: dict[str, jax.Array]) -> dict:
    if isinstance(module, nn.Module):
        return module.variable("quant_stats", name, averaging.init, calibration).value
    existing = getattr(module, name, None)
    if isinstance(existing, flax_util.QuantStat):
        return existing.get_value()
    stat = averaging.init(calibration)
    setattr(module, name, flax_util.QuantStat(stat))
    return stat


def _set_stat(module: Any, name: str, stat: dict) -> None:
    if isinstance(module, nn.Module):
        module.put_variable("quant_stats", name, stat)
    else:
        getattr(module, name).set_value(stat)


def _rounding_key(module: Any) -> jax.Array | None:
    """A key for stochastic rounding: from the "stochastic_rounding" rng stream of a Linen
    model (``apply(..., rngs={"stochastic_rounding": key})``) or of an NNX model's
    ``qwix_rngs``; None without one (qt_ops.noise_fn then derives one)."""
    if isinstance(module, nn.Module):
        has = module.has_rng("stochastic_rounding")
        return module.make_rng("stochastic_rounding") if has else None
    rngs = getattr(module, flax_util.RNGS_ATTR, None)
    return rngs["stochastic_rounding"]() if isinstance(rngs, nnx.Rngs) else None
