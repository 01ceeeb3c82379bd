"""Quantized training (QT): fake quantization with a straight-through estimator.

Forward: each operand of a matched op is quantized and dequantized ("fake quant"), so the float op
sees exactly the values a PTQ model will compute with; the gradient passes straight through the
rounding. Backward (``bwd_qtype``): the output gradient is fake-quantized too, once for each
operand's gradient (the weight's optionally tiled along the batch axis, either optionally with
stochastic rounding); see the section "quantized backward pass" below.

Static-range activations keep additive statistics (averaging.py) in the ``quant_stats`` collection
(Linen) or ``QuantStat`` variables (NNX), named ``<op_id>_{lhs,rhs}``; quantize_params and the
NNX PtqProvider turn them into static scales.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from qmill.engine.core import averaging, qarray, qtypes, sparsity, stochastic_rounding
from qmill.engine.modeling import flax_util, rules
from qmill.engine.ops import op_adapter
from qmill.engine.providers import base, model

_DEFAULT_QT = rules.QtRule()


def _qt_setting(rule: rules.QuantizationRule, name: str) -> Any:
    # Plain QuantizationRules are accepted and behave as QtRules with default QT settings.
    return getattr(rule, name, getattr(_DEFAULT_QT, name))


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


def qt_option(rule: rules.QuantizationRule, name: str, default: Any) -> Any:
    """A DotGeneralQtConfig field set through the rule's ``additional_qt_config`` (the
    reference's override); ``sparsity_rule`` may also be a field of the rule itself."""
    extra = getattr(rule, "additional_qt_config", None) or {}
    return extra.get(name, getattr(rule, name, default))


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
        return self._run(rule, op_id, module, lhs, rhs, how, _Op(compute, layout))

    def einsum(self, einsum_str, *operands, **kwargs) -> jax.Array:
        rule, op_id, module = self.current_rule_and_op_id("einsum")
        if rule is None or rule.weight_qtype is None or len(operands) != 2:
            return jnp.einsum(einsum_str, *operands, **kwargs)
        lhs, rhs = operands
        how = op_adapter.einsum_how(rule, lhs, rhs, einsum_str)
        kwargs.pop("_dot_general", None)
        layout = op_adapter.einsum_grad_layout(einsum_str)
        if layout is None and _qt_setting(rule, "bwd_qtype") is not None:
            raise ValueError(
                f"bwd_qtype needs an explicit einsum ('ab,bc->ac'); got {einsum_str!r}. Spell out "
                "the output (no '...'), or leave this op's gradients in floating point."
            )
        compute = lambda a, b: jnp.einsum(einsum_str, a, b, **kwargs)  # noqa: E731
        return self._run(rule, op_id, module, lhs, rhs, how, _Op(compute, layout))

    def conv_general_dilated(self, lhs, rhs, window_strides, padding, *args, **kwargs):
        def compute(a, b):
            return jax.lax.conv_general_dilated(a, b, window_strides, padding, *args, **kwargs)

        rule, op_id, module = self.current_rule_and_op_id("conv_general_dilated")
        if rule is None or rule.weight_qtype is None:
            return compute(lhs, rhs)
        dn_arg = kwargs.get("dimension_numbers", args[2] if len(args) > 2 else None)
        dn = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, dn_arg)
        how, layout = op_adapter.conv_how(rule, dn), op_adapter.conv_grad_layout(dn)
        return self._run(rule, op_id, module, lhs, rhs, how, _Op(compute, layout))

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

    # ---- the fake-quantized op ----------------------------------------------------------------

    def _run(self, rule, op_id, module, lhs, rhs, how, compute) -> jax.Array:
        operands = []
        weight_side = None
        clip = not qt_option(rule, "disable_gradient_clipping", False)
        sparsity_rule = qt_option(rule, "sparsity_rule", None)
        for side, x in (("lhs", lhs), ("rhs", rhs)):
            for_lhs = side == "lhs"
            is_weight = flax_util.find_param(x, module) is not None
            if side == "rhs" and sparsity_rule is not None:
                # The rhs, before quantization, as the reference: the kept values get the range.
                x = sparsity.sparsify(x, sparsity_rule)
            if is_weight:
                weight_side = side
                h = self._maybe_per_tensor(rule, how.weight(for_lhs))
                calibration = None
            elif rule.act_qtype is not None:
                h = self._maybe_per_tensor(rule, how.act(for_lhs))
                name = None if op_id is None else f"{op_id}_{side}"
                calibration = self.act_calibration(module, x, h, rule, name)
            else:
                operands.append(x)
                continue
            fq = _quantize_with(x, h, calibration)
            operands.append(clipped_ste(x, fq, h, calibration) if clip else ste(x, fq))
        if _qt_setting(rule, "bwd_qtype") is None:
            return compute(*operands)
        cfg = _BwdConfig.of(rule, compute.grad_layout, weight_side)
        return _with_quantized_grad(compute, cfg, _rounding_key(module, cfg), *operands)

    def _maybe_per_tensor(self, rule, how: qarray.HowToQuantize) -> qarray.HowToQuantize:
        if _qt_setting(rule, "disable_channelwise_axes"):
            return dataclasses.replace(how, channelwise_axes=())
        return how

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
    """The float op on two operands, with the layout of its output gradient.

    Subclasses overriding ``_run`` just call it; the layout rides along for the backward pass.
    """

    fn: Callable[[jax.Array, jax.Array], jax.Array]
    grad_layout: op_adapter.GradLayout | None

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


# ---- quantized backward pass ------------------------------------------------------------------
#
# With bwd_qtype, the output gradient g is fake-quantized before each operand's gradient is
# computed from it, the way the forward pass quantizes operands for the op: for the lhs gradient
# (g contracted with rhs over rhs's free axes) g gets one scale per index of its batch and lhs
# axes; for the rhs gradient one per index of its batch and rhs axes. disable_channelwise_axes
# makes both one scale per tensor. For the *weight's* gradient, bwd_weight_grad_tile_size also
# tiles the last axis that gradient contracts (the batch axis of a dense layer), so that a few
# outlier examples don't flatten the scale of all the others.


@dataclasses.dataclass(frozen=True)
class _BwdConfig:
    qtype: Any
    calibration_method: str
    weight_grad_tile_size: int | float | None
    stochastic_rounding: str | None
    noise_axes: tuple[int, ...]
    per_tensor: bool
    layout: op_adapter.GradLayout
    weight_side: str | None  # "lhs", "rhs" or None (two activations)
    # Per side ("lhs", "rhs"): the reference's DotGeneralQtConfig overrides given through
    # additional_qt_config (dlhs_grad_qtype, drhs_tile_size, ...); None where not given.
    qtype_by_side: tuple[Any, Any] = (None, None)
    tile_by_side: tuple[Any, Any] = (None, None)

    @classmethod
    def of(cls, rule, layout: op_adapter.GradLayout, weight_side: str | None) -> _BwdConfig:
        bwd_qtype = _qt_setting(rule, "bwd_qtype")
        return cls(
            bwd_qtype,
            _qt_setting(rule, "bwd_calibration_method"),
            _qt_setting(rule, "bwd_weight_grad_tile_size"),
            _qt_setting(rule, "bwd_stochastic_rounding"),
            tuple(_qt_setting(rule, "channelwise_noise_axes")),
            _qt_setting(rule, "disable_channelwise_axes"),
            layout,
            weight_side,
            tuple(qt_option(rule, f"{p}_grad_qtype", None) or bwd_qtype for p in ("dlhs", "drhs")),
            tuple(qt_option(rule, f"{p}_tile_size", None) for p in ("dlhs", "drhs")),
        )


def stochastic_noise_fn(
    method: str,
    key: jax.Array,
    noise_axes: Sequence[int] = (0,),
    *,
    channelwise_noise_axes: Sequence[int] | None = None,
) -> stochastic_rounding.NoiseFn:
    """stochastic_rounding.get_noise_fn, with the noise axes also by position (``noise_axes``)
    and the noise broadcast to the full shape asked for.

    The noise varies along ``channelwise_noise_axes`` only. "uniform" draws float noise,
    "low_bit_uniform" 8-bit noise.
    """
    axes = noise_axes if channelwise_noise_axes is None else channelwise_noise_axes
    noise = stochastic_rounding.get_noise_fn(method, key, axes)
    return dataclasses.replace(noise, full_shape=True)


def _rounding_key(module: Any, cfg: _BwdConfig) -> jax.Array | None:
    """Raw key data for stochastic rounding, drawn in the forward pass; None = derive it later.

    Linen models get it from a "stochastic_rounding" rng stream when the caller passes one
    (``apply(..., rngs={"stochastic_rounding": key})``). Otherwise the backward pass derives a
    key from the gradient's bits: different every step, reproducible for equal inputs.
    """
    if cfg.stochastic_rounding is None:
        return None
    if isinstance(module, nn.Module) and module.has_rng("stochastic_rounding"):
        return jax.random.key_data(module.make_rng("stochastic_rounding"))
    return None


def quantize_grad(
    g: jax.Array, cfg: _BwdConfig, side: str, key: jax.Array | None = None
) -> jax.Array:
    """Fake-quantizes the output gradient g for the gradient of operand ``side``."""
    layout = cfg.layout
    own = layout.lhs_free if side == "lhs" else layout.rhs_free
    contracted = layout.rhs_free if side == "lhs" else layout.lhs_free
    channelwise = () if cfg.per_tensor else (*layout.batch, *own)
    index = 0 if side == "lhs" else 1
    qtype, tile = cfg.qtype_by_side[index] or cfg.qtype, cfg.tile_by_side[index]
    if tile is None and side == cfg.weight_side:
        tile = cfg.weight_grad_tile_size
    # mx / nv formats come with their block, as the reference infers it.
    tile = tile or qtypes.get(qtype).required_tile
    # The last axis the gradient contracts, as the reference tiles it.
    tiled = {contracted[-1]: tile} if tile and contracted else {}
    noise = (
        None if key is None else stochastic_noise_fn(cfg.stochastic_rounding, key, cfg.noise_axes)
    )
    how = qarray.HowToQuantize(
        qtype=qtype,
        channelwise_axes=channelwise,
        tiled_axes=tiled,
        calibration_method=cfg.calibration_method,
        noise_fn=noise,
    )
    return qarray.dequantize(qarray.quantize(g, how)).astype(g.dtype)


def _with_quantized_grad(compute, cfg: _BwdConfig, key_data, lhs: jax.Array, rhs: jax.Array):
    @jax.custom_vjp
    def op(a, b, key_data):
        return compute(a, b)

    def fwd(a, b, key_data):
        return compute(a, b), (a, b, key_data)

    def bwd(res, g):
        a, b, key_data = res
        keys = (None, None)
        if cfg.stochastic_rounding is not None:
            if key_data is None:
                seed = jax.lax.bitcast_convert_type(jnp.sum(g.astype(jnp.float32)), jnp.uint32)
                key = jax.random.fold_in(jax.random.key(0), seed)
            else:
                key = jax.random.wrap_key_data(key_data)
            keys = (jax.random.fold_in(key, 0), jax.random.fold_in(key, 1))
        _, vjp = jax.vjp(compute, a, b)
        da, _ = vjp(quantize_grad(g, cfg, "lhs", keys[0]))
        _, db = vjp(quantize_grad(g, cfg, "rhs", keys[1]))
        return da, db, None

    op.defvjp(fwd, bwd)
    return op(lhs, rhs, key_data)
