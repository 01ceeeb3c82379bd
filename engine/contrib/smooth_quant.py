"""SmoothQuant (Xiao et al., 2023, arXiv:2211.10438): move activation outliers into the weights.

Per input channel j, with a_j the activation scale and w_j the weight scale the rule's qtypes
would give channel j (absmax / bound, channelwise over the contracted axis):
  s_j = clip(a_j**α / w_j**(1−α), 1e-5)
The weight is quantized as Q(W · s) (s along the contracted axis) and the activation is
multiplied by 1/s before the op, so that x·W = (x/s)·(s·W). Statistics are averaged over batches
as {"sq_scale": s, "inv_sq_scale": 1/s} (each averaged on its own, as the reference does).

Param layout (the reference's): a SmoothQuant weight is a WithSqScale, `<name>/array/...` as PTQ
writes it plus `<name>/inv_sq_scale` (in_features,). SqInferenceProvider multiplies the
activation by inv_sq_scale and runs the op with the quantized weight (activations stay float,
as in the reference).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from qmill.engine.contrib import calibration
from qmill.engine.core import qarray
from qmill.engine.modeling import rules as rules_lib
from qmill.engine.ops import dot_general as dot_general_lib
from qmill.engine.ops import einsum as einsum_lib
from qmill.engine.providers import ptq

_STATS_SUFFIX = "_sq"


def compute_scales_ratio(act_stats: jax.Array, weight_stats: jax.Array, alpha: float) -> jax.Array:
    """s = clip(act**α / weight**(1−α), 1e-5), in the weight statistics' dtype."""
    scales = act_stats**alpha / weight_stats ** (1 - alpha)
    return jnp.clip(scales, min=1e-5).astype(weight_stats.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SqRule(rules_lib.QuantizationRule):
    """A QuantizationRule whose matched weights SmoothQuant quantizes (needs act_qtype);
    alpha: how much of the activation range moves into the weights (0.5 by default)."""

    alpha: float = 0.5


@flax.struct.dataclass(kw_only=True)
class WithSqScale(ptq.WithAux[qarray.QArray]):
    """A quantized weight Q(W · s) with inv_sq_scale = 1/s (in_features,), applied to the
    activation along its contracted axis."""

    inv_sq_scale: jax.Array
    contracting_axis: int = flax.struct.field(pytree_node=False)


nnx.register_data_type(WithSqScale)


def _symmetric_scale(x: jax.Array, qtype: Any, method: str, what: str) -> jax.Array:
    how = qarray.HowToQuantize(qtype=qtype, channelwise_axes=(0,), calibration_method=method)
    scale, zero_point = qarray.compute_scale_zero_point(qarray.calibrate(x, how), qtype)
    if zero_point is not None:
        raise ValueError(
            f"SmoothQuant needs symmetric {what} quantization; {method!r} gives a zero point. "
            "Use an absmax calibration method."
        )
    return scale


class SqCalibrationProvider(calibration.SinglePassCalibrationProvider):
    """Averages each SqRule weight's smoothing scales into quant_stats `<weight>_sq`
    ({"count", "sum_of_sq_scale", "sum_of_inv_sq_scale"}); runs the float model."""

    def get_rule_type(self) -> type[rules_lib.QuantizationRule]:
        return SqRule

    def get_stats_suffix(self) -> str:
        return _STATS_SUFFIX

    def compute_stats(
        self, lhs: jax.Array, weight: jax.Array | None = None, rule: Any = None
    ) -> dict[str, jax.Array]:
        """Scales from one batch's input (contracting, samples) and the weight (contracting,
        rest); without them, the running module's `kernel` and the current rule (as the
        reference finds them)."""
        if rule is None:
            rule = self.current_rule("dot_general")
        if weight is None:
            weight = jnp.asarray(_kernel())
        if not isinstance(rule, SqRule):
            raise ValueError(f"SmoothQuant statistics need an SqRule, got {type(rule).__name__}")
        if rule.act_qtype is None:
            raise ValueError(
                f"{rule} has no act_qtype: SmoothQuant balances the activation's range against "
                "the weight's and needs both qtypes. Set act_qtype."
            )
        w_scale = _symmetric_scale(
            weight, rule.weight_qtype, rule.weight_calibration_method, "weight"
        )
        a_scale = _symmetric_scale(lhs, rule.act_qtype, rule.resolved_act_calibration_method, "act")
        sq = compute_scales_ratio(a_scale, w_scale, alpha=rule.alpha).reshape(-1)
        return {"sq_scale": sq, "inv_sq_scale": 1 / sq}

    def _collect_stats(self, lhs, weight_name, *, module=None, weight=None, rule=None, **_):
        self._accumulate(self.compute_stats(lhs, weight, rule), weight_name, module)


def _kernel() -> Any:
    from qmill.engine.modeling import flax_util  # the running module, only for the reference's path

    module = flax_util.get_current_module()
    kernel = flax_util.get_variable(module, "params", "kernel")
    if kernel is None:
        raise NotImplementedError(f"{type(module).__name__} has no `kernel` param to smooth")
    return kernel


def quantize_params(
    params: Any,
    abstract_quantized_params: Any,
    sq_quant_stats: Any,
    *,
    allow_extra_params: bool = False,
) -> Any:
    """ptq.quantize_params, with SmoothQuant (a WithSqScale) for weights with `<weight>_sq`
    statistics. Returns the params for SqInferenceProvider (NNX: a pure dict)."""

    def quantize(ctx: calibration.CalibratedQuantContext) -> Any:
        sq = ctx.channel_stat("sq_scale", "SmoothQuant")
        q = qarray.quantize(ctx.weight * sq, ctx.how)
        return ctx.with_scale(WithSqScale, q, inv_sq_scale=ctx.calibration_stats["inv_sq_scale"])

    return calibration.quantize_params_with_calibration(
        params,
        abstract_quantized_params,
        sq_quant_stats,
        _STATS_SUFFIX,
        quantize,
        allow_extra_params=allow_extra_params,
        pure_nnx=False,
    )


def _smooth(lhs: Any, inv: jax.Array, axis: int) -> jax.Array:
    if isinstance(lhs, qarray.QArray):
        raise NotImplementedError("the input of a SmoothQuant op must not be quantized already")
    shape = [1] * jnp.ndim(lhs)
    shape[axis] = inv.shape[0]
    return lhs * inv.reshape(shape)


def _weight(rhs: Any) -> Any:
    return rhs.array if isinstance(rhs, ptq.WithAux) else rhs


class SqInferenceProvider(ptq.PtqProvider):
    """Serves SmoothQuant params: for a WithSqScale weight the activation is multiplied by
    inv_sq_scale along its contracted axis, then the op runs with the quantized weight and the
    float activation (the reference's behaviour); other quantized weights run the same way."""

    def dot_general(
        self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw
    ) -> jax.Array:
        if isinstance(rhs, WithSqScale):
            (lc, _), _ = dimension_numbers
            lhs = _smooth(lhs, rhs.inv_sq_scale, lc[0])
        return dot_general_lib.dot_general(
            lhs, _weight(rhs), dimension_numbers, precision, preferred_element_type, **kw
        )

    def einsum(self, einsum_str: Any, *operands: Any, **kwargs: Any) -> jax.Array:
        if len(operands) != 2 or not any(isinstance(x, ptq.WithAux) for x in operands):
            return super().einsum(einsum_str, *operands, **kwargs)
        lhs, rhs = operands
        if isinstance(rhs, WithSqScale):
            plan = einsum_lib._plan(einsum_str, tuple(jnp.shape(lhs)), rhs.shape)
            (lc, _), _ = plan.dimension_numbers
            if len(lc) != 1 or any(plan.squeeze):
                raise NotImplementedError(f"SmoothQuant einsum {einsum_str!r}: one contracted axis")
            lhs = _smooth(lhs, rhs.inv_sq_scale, lc[0])
        return einsum_lib.einsum(einsum_str, lhs, _weight(rhs), **kwargs)
