"""ragged_dot with quantized forward and (optionally) quantized backward passes (QT).

Forward: lhs [m, k] quantized with a scale per row, rhs [g, k, n] with a scale per column shared
by the groups (constant along k and g, so ops.ragged_dot multiplies the codes natively).

Backward, gradients taken straight through the quantization (w.r.t. the dequantized operands):
  dlhs [m, k] = ragged_dot(g [m, n], rhs [g, n, k] after swapping k and n)
  drhs [g, k, n] = per group, lhs rows^T · g rows (jax.lax.ragged_dot_general, m contracted)
With a *_grad_qtype the incoming gradient is quantized too. The other operand's scale varies
along the contracted axis (rhs's along n, lhs's along m), so it is folded into the gradient
first; the gradient then gets one scale per row (dlhs) or per column (drhs), constant along the
contraction, and the codes of both sides are multiplied natively.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from qmill.engine.core import qarray
from qmill.engine.modeling import interception
from qmill.engine.ops import ragged_dot as ragged_dot_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaggedDotQtConfig:
    """Which sides of ragged_dot_qt are quantized, forward and backward (None: not quantized)."""

    lhs_qtype: Any = None
    rhs_qtype: Any = None
    dlhs_grad_qtype: Any = None
    drhs_grad_qtype: Any = None


def _unit(codes: jax.Array, dtype: Any, qtype: Any) -> qarray.QArray:
    """Codes as a QArray with scale 1 (their real scale was folded into the other operand)."""
    return qarray.QArray(codes, jnp.ones((1,) * codes.ndim, dtype), None, qtype)


@interception.disable_interceptions
def _fwd(lhs, rhs, group_sizes, config, precision, preferred_element_type, group_offset):
    qlhs, qrhs = lhs, rhs
    if config.lhs_qtype is not None:
        how = qarray.HowToQuantize(qtype=config.lhs_qtype, channelwise_axes=(0,))
        qlhs = qarray.quantize(lhs, how)
    if config.rhs_qtype is not None:
        how = qarray.HowToQuantize(qtype=config.rhs_qtype, channelwise_axes=(2,))
        qrhs = qarray.quantize(rhs, how)
    out = ragged_dot_lib.ragged_dot(
        qlhs, qrhs, group_sizes, precision, preferred_element_type, group_offset
    )
    return out, (qlhs, qrhs, group_sizes)


def _dlhs(g, rhs, group_sizes, config, precision, preferred_element_type, group_offset):
    if not config.dlhs_grad_qtype:
        rhs = qarray.dequantize(rhs) if isinstance(rhs, qarray.QArray) else rhs
        return ragged_dot_lib.ragged_dot(
            g,
            jnp.swapaxes(rhs, 1, 2),
            group_sizes,
            precision,
            preferred_element_type,
            group_offset,
        )
    if isinstance(rhs, qarray.QArray):
        g = g * rhs.scale[:, 0, :].astype(g.dtype)  # [1, n]: varies along the contraction
        rhs_t = _unit(jnp.swapaxes(rhs.qvalue, 1, 2), g.dtype, rhs.qtype)
    else:
        rhs_t = jnp.swapaxes(rhs, 1, 2)
    qg = qarray.quantize(
        g, qarray.HowToQuantize(qtype=config.dlhs_grad_qtype, channelwise_axes=(0,))
    )
    if not isinstance(rhs_t, qarray.QArray):
        qg = qarray.dequantize(qg)
    return ragged_dot_lib.ragged_dot(
        qg, rhs_t, group_sizes, precision, preferred_element_type, group_offset
    )


_DRHS_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
)


def _drhs(g, lhs, group_sizes, config, precision, preferred_element_type):
    def general(a, b, pet):
        return jax.lax.ragged_dot_general(
            a, b, group_sizes, _DRHS_DIMS, precision=precision, preferred_element_type=pet
        )

    if not config.drhs_grad_qtype or not isinstance(lhs, qarray.QArray):
        a = qarray.dequantize(lhs) if isinstance(lhs, qarray.QArray) else lhs
        if config.drhs_grad_qtype:
            how = qarray.HowToQuantize(qtype=config.drhs_grad_qtype, channelwise_axes=(1,))
            g = qarray.dequantize(qarray.quantize(g, how))
        return general(a, g.astype(a.dtype), preferred_element_type)
    g = g * lhs.scale.astype(g.dtype)  # [m, 1]: varies along the contraction (m)
    qg = qarray.quantize(
        g, qarray.HowToQuantize(qtype=config.drhs_grad_qtype, channelwise_axes=(1,))
    )
    integer = jnp.issubdtype(lhs.qvalue.dtype, jnp.integer) and jnp.issubdtype(
        qg.qvalue.dtype, jnp.integer
    )
    if integer:
        out = general(lhs.qvalue.astype(jnp.int8), qg.qvalue.astype(jnp.int8), jnp.int32)
    else:
        out = general(lhs.qvalue.astype(jnp.bfloat16), qg.qvalue.astype(jnp.bfloat16), jnp.float32)
    out = out.astype(jnp.float32) * qg.scale.astype(jnp.float32)[None]  # [1, 1, n]
    return out.astype(preferred_element_type or g.dtype)


@interception.disable_interceptions
def _bwd(config, precision, preferred_element_type, group_offset, residuals, g):
    lhs, rhs, group_sizes = residuals
    dlhs = _dlhs(g, rhs, group_sizes, config, precision, preferred_element_type, group_offset)
    drhs = _drhs(g, lhs, group_sizes, config, precision, preferred_element_type)
    return dlhs, drhs, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def ragged_dot_qt(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    config: RaggedDotQtConfig,
    precision: Any = None,
    preferred_element_type: Any = None,
    group_offset: jax.Array | None = None,
) -> jax.Array:
    """jax.lax.ragged_dot with `config`'s quantization forward and backward."""
    out, _ = _fwd(lhs, rhs, group_sizes, config, precision, preferred_element_type, group_offset)
    return out


def _fwd_rule(lhs, rhs, group_sizes, config, precision, preferred_element_type, group_offset):
    return _fwd(lhs, rhs, group_sizes, config, precision, preferred_element_type, group_offset)


ragged_dot_qt.defvjp(_fwd_rule, _bwd)
