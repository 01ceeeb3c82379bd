"""GPTQ in models: GptqRule marks the weights, GptqCalibrationProvider averages each weight's
input Hessian X·Xᵀ over calibration batches, quantize_params applies gptq_core tensor by tensor.

The result is an ordinary PTQ param tree (codes and scales): PtqProvider serves it, and every
checkpoint format that takes PTQ output takes it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from qmill.engine.contrib import calibration, gptq_core
from qmill.engine.modeling import rules as rules_lib

_STATS_SUFFIX = "_gptq"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GptqRule(rules_lib.QuantizationRule):
    """A QuantizationRule whose matched weights GPTQ quantizes (PtqProvider serves them)."""


class GptqCalibrationProvider(calibration.SinglePassCalibrationProvider):
    """Runs the float model and averages each GptqRule weight's input Hessian X·Xᵀ into
    quant_stats `<weight>_gptq` (apply with mutable=["quant_stats"] for every batch)."""

    def get_rule_type(self) -> type[rules_lib.QuantizationRule]:
        return GptqRule

    def get_stats_suffix(self) -> str:
        return _STATS_SUFFIX

    def compute_stats(self, lhs: jax.Array) -> dict[str, jax.Array]:
        return {"hessian": gptq_core.compute_hessian(lhs.astype(jnp.float32))}


def quantize_params(
    params: Any,
    abstract_quantized_params: Any,
    gptq_quant_stats: Any,
    *,
    allow_extra_params: bool = False,
    gptq_block_size: int = 128,
    gptq_damping_factor: float = 0.01,
) -> Any:
    """ptq.quantize_params, with GPTQ for the weights that have `<weight>_gptq` statistics.

    Returns:
      The quantized params for the PTQ model (same structure as ptq.quantize_params gives).
    """

    def quantize(ctx: calibration.CalibratedQuantContext) -> Any:
        hessian = ctx.calibration_stats["hessian"]
        q, _ = gptq_core.quantize_weight(
            ctx.weight,
            hessian,
            ctx.how,
            blocksize=gptq_block_size,
            percdamp=gptq_damping_factor,
        )
        return ctx.abs_w.replace(array=ctx.restore_shape(q))

    return calibration.quantize_params_with_calibration(
        params,
        abstract_quantized_params,
        gptq_quant_stats,
        _STATS_SUFFIX,
        quantize,
        allow_extra_params=allow_extra_params,
    )
