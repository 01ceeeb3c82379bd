"""How the QT provider runs a matched op through the QT ops (ops.dot_general_qt and
ops.conv_general_qt), with the configs the reference's QtProvider builds from a rule.

dot_general and einsum become a dot_general_qt (einsum through the dot_general it lowers to, its
output transposed back); conv_general_dilated a conv_general_qt. The provider hands over the
operands and their calibrations (its static-range statistics included), so the ops quantize
with the scales it chose and clip gradients to the same ranges.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from qmill.engine.core import qarray, stochastic_rounding
from qmill.engine.modeling import rules
from qmill.engine.ops import conv_general_qt, dot_general_qt
from qmill.engine.ops import einsum as einsum_lib

_DEFAULT_QT = rules.QtRule()


def setting(rule: rules.QuantizationRule, name: str) -> Any:
    """A QtRule setting; plain QuantizationRules behave as QtRules with the default settings."""
    return getattr(rule, name, getattr(_DEFAULT_QT, name))


@dataclasses.dataclass(frozen=True)
class QtOp:
    """A matched op run through a QT op: ``run(lhs, rhs, lhs_calibration, rhs_calibration,
    config)``; ``conv`` says which config it takes (ConvGeneralQtConfig, else
    DotGeneralQtConfig)."""

    run: Callable[..., jax.Array]
    conv: bool = False


def _cast(out: jax.Array, preferred_element_type: Any) -> jax.Array:
    return out if preferred_element_type is None else out.astype(preferred_element_type)


def dot_general_op(dimension_numbers, preferred_element_type=None) -> QtOp:
    """jax.lax.dot_general as dot_general_qt."""

    def run(lhs, rhs, cal_l, cal_r, config):
        out = dot_general_qt.dot_general_qt_fwd_bwd(
            lhs, rhs, cal_l, cal_r, dimension_numbers, config
        )
        return _cast(out, preferred_element_type)

    return QtOp(run)


def _reshaped_calibration(calibration, x_shape, squeeze, expand):
    """A calibration following its operand through einsum's broadcasting: squeezed size-1 axes
    dropped, and an expanded axis repeated where the calibration varies along it."""
    if calibration is None:
        return None

    def one(c):
        if expand is not None:
            sizes = zip(c.shape, x_shape, expand, strict=True)
            target = [e if n == s and n != e else n for n, s, e in sizes]
            c = qarray.broadcast_to(c, target)
        return c.reshape([n for a, n in enumerate(c.shape) if a not in squeeze]) if squeeze else c

    return {k: one(v) for k, v in calibration.items()}


def einsum_op(einsum_str: str, lhs_shape, rhs_shape, preferred_element_type=None) -> QtOp:
    """A two-operand einsum as the dot_general_qt it lowers to (ops.einsum's plan): broadcast
    axes squeezed or repeated first, the output transposed to the einsum's order."""
    plan = einsum_lib.lowering(einsum_str, tuple(lhs_shape), tuple(rhs_shape))

    def prepare(x, cal, side):
        squeeze, expand = plan.squeeze[side], plan.expand[side]
        cal = _reshaped_calibration(cal, x.shape, squeeze, expand)
        if expand is not None:
            x = qarray.broadcast_to(x, expand)
        if squeeze:
            x = x.reshape([n for a, n in enumerate(x.shape) if a not in squeeze])
        return x, cal

    def run(lhs, rhs, cal_l, cal_r, config):
        (lhs, cal_l), (rhs, cal_r) = prepare(lhs, cal_l, 0), prepare(rhs, cal_r, 1)
        out = dot_general_qt.dot_general_qt_fwd_bwd(
            lhs, rhs, cal_l, cal_r, plan.dimension_numbers, config
        )
        return _cast(jnp.transpose(out, plan.permutation), preferred_element_type)

    return QtOp(run)


def conv_op(window_strides, padding, *args: Any, **kwargs: Any) -> QtOp:
    """jax.lax.conv_general_dilated (its arguments after the operands) as conv_general_qt."""
    names = (
        "lhs_dilation",
        "rhs_dilation",
        "dimension_numbers",
        "feature_group_count",
        "batch_group_count",
        "precision",
        "preferred_element_type",
    )
    given = dict(zip(names[: len(args)], args, strict=True)) | kwargs
    preferred_element_type = given.pop("preferred_element_type", None)
    given.pop("precision", None)

    def run(lhs, rhs, cal_l, cal_r, config):
        out = conv_general_qt.conv_general_qt_fwd_bwd(
            lhs, rhs, cal_l, cal_r, config, window_strides, padding, **given
        )
        return _cast(out, preferred_element_type)

    return QtOp(run, conv=True)


def _side_settings(rule, is_weight: bool) -> tuple[Any, str]:
    """(qtype, calibration method) of an operand: the rule's weight or activation settings."""
    if is_weight:
        return rule.weight_qtype, rule.weight_calibration_method
    return rule.act_qtype, rule.resolved_act_calibration_method


def config_for(rule, op: QtOp, weights: tuple[bool, bool], noise_fn: Any = None) -> Any:
    """The op's QT config under ``rule`` (as the reference's QtProvider makes it), with
    ``additional_qt_config`` applied last. ``weights``: which operands are weights."""
    (lhs_qtype, lhs_method), (rhs_qtype, rhs_method) = (_side_settings(rule, w) for w in weights)
    bwd_qtype = setting(rule, "bwd_qtype")
    per_tensor = setting(rule, "disable_channelwise_axes")
    common = dict(
        lhs_qtype=lhs_qtype,
        rhs_qtype=rhs_qtype,
        lhs_calibration_method=lhs_method,
        rhs_calibration_method=rhs_method,
        lhs_disable_channelwise_axes=per_tensor,
        rhs_disable_channelwise_axes=per_tensor,
        dlhs_grad_qtype=bwd_qtype,
        drhs_grad_qtype=bwd_qtype,
        dlhs_grad_calibration_method=setting(rule, "bwd_calibration_method"),
        drhs_grad_calibration_method=setting(rule, "bwd_calibration_method"),
        dlhs_grad_disable_channelwise_axes=per_tensor,
        drhs_grad_disable_channelwise_axes=per_tensor,
    )
    if op.conv:  # as the reference's, additional_qt_config is for dot_general configs only
        return conv_general_qt.ConvGeneralQtConfig(**common)
    # The weight's gradient tiles g along the last axis it contracts (bwd_weight_grad_tile_size).
    tile = setting(rule, "bwd_weight_grad_tile_size") if bwd_qtype is not None else None
    config = dot_general_qt.DotGeneralQtConfig(
        **common,
        tile_size=rule.tile_size,
        dlhs_tile_size=tile if weights[0] else None,
        drhs_tile_size=tile if weights[1] else None,
        dlhs_stochastic_rounding_noise_fn=noise_fn,
        drhs_stochastic_rounding_noise_fn=noise_fn,
        # Forward-only QT takes its gradients at the operands as given.
        use_original_residuals=bwd_qtype is None,
    )
    extra = setting(rule, "additional_qt_config") or {}
    return dataclasses.replace(config, **extra) if extra else config


def noise_fn(rule, key: jax.Array | None, lhs: jax.Array, rhs: jax.Array) -> Any:
    """The stochastic-rounding noise of the rule's gradients (None without). Without a key
    (no rng stream) one is derived from the operands' values: different every step,
    reproducible for equal inputs."""
    method = setting(rule, "bwd_stochastic_rounding")
    if setting(rule, "bwd_qtype") is None or method is None:
        return None
    if key is None:
        key = jax.random.key(0)
        for x in (lhs, rhs):
            total = jnp.sum(jax.lax.stop_gradient(x).astype(jnp.float32))
            key = jax.random.fold_in(key, jax.lax.bitcast_convert_type(total, jnp.uint32))
    axes = setting(rule, "channelwise_noise_axes")
    return stochastic_rounding.get_noise_fn(method, key, axes)
