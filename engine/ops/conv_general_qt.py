"""conv_general_dilated for quantized training (QT); see dot_general_qt for the scheme.

Forward: the operands fake-quantized as PTQ's conv quantizes them (lhs per batch item, rhs per
output feature). Backward: with a grad qtype the output gradient is fake-quantized, for dlhs with
a scale per batch item and spatial position, for drhs with one per output feature.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax

from qmill.engine.ops import conv_general as conv_general_lib
from qmill.engine.ops import dot_general_qt, op_adapter


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConvGeneralQtConfig:
    """How conv_general_qt quantizes each side, forward and backward (qtype None: not at all)."""

    # Forward pass.
    lhs_qtype: Any = None
    rhs_qtype: Any = None
    lhs_calibration_method: str = "absmax"
    rhs_calibration_method: str = "absmax"
    # One scale for the whole operand instead of one per batch item / output feature.
    lhs_disable_channelwise_axes: bool = False
    rhs_disable_channelwise_axes: bool = False
    # Backward pass: the output gradient as used for the lhs / rhs gradient.
    dlhs_grad_qtype: Any = None
    drhs_grad_qtype: Any = None
    dlhs_grad_calibration_method: str = "absmax"
    drhs_grad_calibration_method: str = "absmax"
    dlhs_grad_disable_channelwise_axes: bool = False
    drhs_grad_disable_channelwise_axes: bool = False


def conv_general_qt(
    lhs: jax.Array,
    rhs: jax.Array,
    config: ConvGeneralQtConfig,
    window_strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
) -> jax.Array:
    """jax.lax.conv_general_dilated with QT's quantized forward and backward passes."""
    dn = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    hows = dot_general_qt.forward_hows(
        config, functools.partial(conv_general_lib.get_how_to_quantize, dimension_numbers=dn)
    )

    def op(a, b):
        return jax.lax.conv_general_dilated(
            a,
            b,
            window_strides,
            padding,
            lhs_dilation,
            rhs_dilation,
            dn,
            feature_group_count,
            batch_group_count,
        )

    layout = op_adapter.conv_grad_layout(dn)
    dlhs, drhs = dot_general_qt.grad_quants(config)
    return dot_general_qt.qt_call(op, layout, hows[0], hows[1], dlhs, drhs, lhs, rhs)
