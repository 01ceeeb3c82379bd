"""AWQ in models: AwqRule marks the weights, AwqCalibrationProvider averages each weight's mean
input magnitude per channel, quantize_params applies awq_core tensor by tensor, and
AwqInferenceProvider serves the result.

Param layout (the reference's): an AWQ weight is a WithAwqScale, i.e. `<name>/array/{qvalue,
scale[,zero_point]}` as PTQ writes it plus `<name>/awq_scale` (in_features,), the per-channel
factor the codes were scaled up by; inference divides the dequantized weight by it along the
contracted axis. Weights without statistics are quantized as PTQ does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
from flax import nnx

from qmill.engine.contrib import awq_core, calibration
from qmill.engine.core import qarray
from qmill.engine.modeling import rules as rules_lib
from qmill.engine.providers import ptq

_STATS_SUFFIX = "_awq"


@dataclasses.dataclass(frozen=True, kw_only=True)
class AwqRule(rules_lib.QuantizationRule):
    """A QuantizationRule whose matched weights AWQ quantizes; n_grid: grid points searched."""

    n_grid: int = 20


@flax.struct.dataclass(kw_only=True)
class WithAwqScale(ptq.WithAux[qarray.QArray]):
    """A quantized weight with its AWQ per-channel scales.

    awq_scale: (in_features,), broadcast along `contracting_axis` of the weight.
    """

    awq_scale: jax.Array
    contracting_axis: int = flax.struct.field(pytree_node=False)

    def __jax_array__(self) -> jax.Array:
        """`jnp.asarray(w)`: the weight it stands for (dequantized, scales divided out)."""
        return dequantize(self)


nnx.register_data_type(WithAwqScale)


def dequantize(w: WithAwqScale) -> jax.Array:
    """The float weight a WithAwqScale stands for: dequantize(array) / awq_scale."""
    dq = qarray.dequantize(w.array)
    shape = [1] * dq.ndim
    shape[w.contracting_axis] = w.awq_scale.shape[0]
    return dq / w.awq_scale.reshape(shape)


class AwqCalibrationProvider(calibration.SinglePassCalibrationProvider):
    """Averages each AwqRule weight's mean input magnitude per channel into quant_stats
    `<weight>_awq` ({"count", "sum_of_act_scale"}); runs the float model."""

    def get_rule_type(self) -> type[rules_lib.QuantizationRule]:
        return AwqRule

    def compute_stats(self, lhs: jax.Array) -> dict[str, jax.Array]:
        return {"act_scale": awq_core.compute_act_scale(lhs, axis=1)}

    def get_stats_suffix(self) -> str:
        return _STATS_SUFFIX


def quantize_params(
    params: Any,
    abstract_quantized_params: Any,
    awq_quant_stats: Any,
    *,
    allow_extra_params: bool = False,
    n_grid: int = 20,
) -> Any:
    """ptq.quantize_params, with AWQ (a WithAwqScale) for weights with `<weight>_awq` stats.

    Returns:
      The quantized params for AwqInferenceProvider (NNX: a pure dict for nnx.update).
    """

    def quantize(ctx: calibration.CalibratedQuantContext) -> Any:
        act_scale = ctx.channel_stat("act_scale", "AWQ")
        q, scales = awq_core.quantize_weight(ctx.weight, act_scale, ctx.how, n_grid=n_grid)
        return ctx.with_scale(WithAwqScale, q, awq_scale=scales.reshape(-1))

    return calibration.quantize_params_with_calibration(
        params,
        abstract_quantized_params,
        awq_quant_stats,
        _STATS_SUFFIX,
        quantize,
        allow_extra_params=allow_extra_params,
    )


def _float(x: Any) -> Any:
    return dequantize(x) if isinstance(x, WithAwqScale) else x


class AwqInferenceProvider(ptq.PtqProvider):
    """PtqProvider that also takes WithAwqScale weights: they are dequantized and divided by
    their AWQ scales, then the op runs as PTQ runs it for a float operand that is not a param
    (float compute, activations quantized if the rule says so)."""

    def dot_general(self, lhs, rhs, dimension_numbers, precision=None, **kwargs) -> jax.Array:
        return super().dot_general(lhs, _float(rhs), dimension_numbers, precision, **kwargs)

    def einsum(self, einsum_str: Any, *operands: Any, **kwargs: Any) -> jax.Array:
        return super().einsum(einsum_str, *(_float(x) for x in operands), **kwargs)


__all__ = [
    "AwqCalibrationProvider",
    "AwqInferenceProvider",
    "AwqRule",
    "WithAwqScale",
    "dequantize",
    "quantize_params",
]
