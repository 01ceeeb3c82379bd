"""Quantized conv_general_dilated.

Lingo (jax.lax.ConvDimensionNumbers): lhs_spec = (batch N, feature C, spatial...), rhs_spec =
(out feature O, in feature I, spatial...), out_spec = (N, C, spatial...). A conv sums over I and
the window, so integer convolution is exact maths when the lhs scale varies at most along N and
the rhs scale at most along O; the two scales then multiply the output along its N and C axes.
Anything else (nf4, zero points, finer scales, batch groups) is dequantized first.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from qmill.engine.core import qarray, qtypes
from qmill.engine.ops import dot_general as dot_general_lib


def get_how_to_quantize(
    *,
    dimension_numbers: jax.lax.ConvDimensionNumbers,
    for_lhs: bool,
    qtype: Any,
    calibration_method: str = "absmax",
) -> qarray.HowToQuantize:
    """lhs: one scale per batch item (N); rhs: one scale per output feature (O)."""
    axis = dimension_numbers.lhs_spec[0] if for_lhs else dimension_numbers.rhs_spec[0]
    return qarray.HowToQuantize(
        qtype=qtype, channelwise_axes=(axis,), calibration_method=calibration_method
    )


def _only_along(s: jax.Array, axis: int) -> bool:
    return all(n == 1 for i, n in enumerate(s.shape) if i != axis)


def conv_general_dilated(
    lhs: jax.Array | qarray.QArray,
    rhs: jax.Array | qarray.QArray,
    window_strides: Any,
    padding: Any,
    lhs_dilation: Any = None,
    rhs_dilation: Any = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    scales_in_result_dtype: bool = False,
) -> jax.Array:
    """jax.lax.conv_general_dilated accepting QArrays.

    ``scales_in_result_dtype``: on the native path, a float product accumulates in the result
    dtype and the scales multiply the output in it one at a time (as ops.dot_general's);
    qmill's QT uses it for the reference's numbers."""
    dims = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)

    def lax_conv(a: jax.Array, b: jax.Array, pet: Any, precision: Any = precision) -> jax.Array:
        return jax.lax.conv_general_dilated(
            a,
            b,
            window_strides,
            padding,
            lhs_dilation=lhs_dilation,
            rhs_dilation=rhs_dilation,
            dimension_numbers=dims,
            feature_group_count=feature_group_count,
            batch_group_count=batch_group_count,
            precision=precision,
            preferred_element_type=pet,
        )

    def conv(a: jax.Array, b: jax.Array, pet: Any) -> jax.Array:
        if pet == jnp.int32 and jnp.issubdtype(a.dtype, jnp.integer):
            return _integer_conv(lax_conv, a, b)
        return lax_conv(a, b, pet)

    if (
        isinstance(lhs, qarray.QArray)
        and isinstance(rhs, qarray.QArray)
        and batch_group_count == 1
        and lhs.zero_point is None
        and rhs.zero_point is None
        and _only_along(lhs.scale, dims.lhs_spec[0])
        and _only_along(rhs.scale, dims.rhs_spec[0])
    ):
        ql, qr = qtypes.get(lhs.qtype), qtypes.get(rhs.qtype)
        if ql.native_matmul and qr.native_matmul and ql.kind == qr.kind:
            integer = ql.kind == qtypes.INT
            cast = jnp.int8 if integer else jnp.bfloat16
            dtype = preferred_element_type or jnp.result_type(lhs.scale.dtype, rhs.scale.dtype)
            # Scales in float32 (one rounding), or in the promoted dtype one at a time.
            acc = jnp.int32 if integer else dtype if scales_in_result_dtype else jnp.float32
            out = conv(lhs.qvalue.astype(cast), rhs.qvalue.astype(cast), acc)
            shape_n = [1] * out.ndim
            shape_n[dims.out_spec[0]] = lhs.scale.shape[dims.lhs_spec[0]]
            shape_c = [1] * out.ndim
            shape_c[dims.out_spec[1]] = rhs.scale.shape[dims.rhs_spec[0]]
            s_n, s_c = lhs.scale.reshape(shape_n), rhs.scale.reshape(shape_c)
            if not scales_in_result_dtype:
                out, s_n, s_c = (a.astype(jnp.float32) for a in (out, s_n, s_c))
            return (out * s_n * s_c).astype(dtype)
    a, b, preferred_element_type = dot_general_lib.plain_operands(
        lhs, rhs, preferred_element_type, same_dtype=True
    )
    return conv(a, b, preferred_element_type)


def _integer_conv(lax_conv: Any, a: jax.Array, b: jax.Array) -> jax.Array:
    """a ⊛ b of integer codes, accumulated in int32. XLA's GPU backend cannot compile that
    (cuDNN's integer convolutions give int8 or float32 only: UNIMPLEMENTED), so there the codes
    are convolved as float32 at full precision and the sums rounded back: the integer result
    exactly whenever no partial sum reaches 2^24 (int8 codes: up to 1,024 terms per output, in
    features × window taps), within float32 accumulation (2^-24 relative) beyond. Elsewhere the
    integer convolution itself. (Chosen when traced, by the default backend, rather than by
    lax.platform_dependent, which would put both convolutions in every program's jaxpr.)"""
    if jax.default_backend() != "gpu":
        return lax_conv(a, b, jnp.int32)
    f32 = lax_conv(a.astype(jnp.float32), b.astype(jnp.float32), jnp.float32, "highest")
    return jnp.round(f32).astype(jnp.int32)
