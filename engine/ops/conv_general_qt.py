"""conv_general_dilated for quantized training (QT); see dot_general_qt for the scheme.

Forward: the operands quantized as PTQ's conv quantizes them (lhs one scale per batch item, rhs
one per output feature) and convolved as QArrays (ops.conv_general_dilated: int8 codes into
int32, both scales applied to the output). The residuals are the quantized operands.

Backward, the two transposed convolutions of the forward one (lhs gradient: g with the kernel
flipped in space and its feature axes swapped; kernel gradient: the input with g as the window).
With a grad qtype, the other operand's scale is multiplied into g first (the kernel's lies along
g's feature axis, the input's along g's batch axis), so that operand enters as its bare codes;
g is then quantized with one scale per batch item (lhs gradient) or per output feature (kernel
gradient), constant along what the transposed convolution sums, and the codes are convolved
natively too. Grouped convolutions (feature or batch groups) take their gradients through JAX's
own transposes of the float op instead, at the dequantized residuals and quantized gradients.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax

from qmill.engine.core import numerics_api, qarray
from qmill.engine.modeling import interception
from qmill.engine.ops import conv_general as conv_general_lib
from qmill.engine.ops import qt_products


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


@dataclasses.dataclass(frozen=True)
class _Conv:
    """The forward convolution's static arguments (hashable: a custom_vjp nondiff argument)."""

    window_strides: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    lhs_dilation: tuple[int, ...]
    rhs_dilation: tuple[int, ...]
    dn: jax.lax.ConvDimensionNumbers
    feature_group_count: int
    batch_group_count: int

    def __call__(self, a: Any, b: Any) -> jax.Array:
        return conv_general_lib.conv_general_dilated(
            a,
            b,
            self.window_strides,
            self.padding,
            self.lhs_dilation,
            self.rhs_dilation,
            self.dn,
            self.feature_group_count,
            self.batch_group_count,
            scales_in_result_dtype=True,
        )


def _conv(lhs_shape, rhs_shape, window_strides, padding, lhs_dilation, rhs_dilation, dn, fgc, bgc):
    dn = jax.lax.conv_dimension_numbers(lhs_shape, rhs_shape, dn)
    n = len(lhs_shape) - 2
    lhs_dilation = tuple(lhs_dilation or (1,) * n)
    rhs_dilation = tuple(rhs_dilation or (1,) * n)
    if isinstance(padding, str):
        in_sizes = [lhs_shape[a] for a in dn.lhs_spec[2:]]
        kernel = [rhs_shape[a] for a in dn.rhs_spec[2:]]
        window = [_dilated(k, d) for k, d in zip(kernel, rhs_dilation, strict=True)]
        padding = jax.lax.padtype_to_pads(in_sizes, window, window_strides, padding)
    pads = tuple((int(lo), int(hi)) for lo, hi in padding)
    return _Conv(tuple(window_strides), pads, lhs_dilation, rhs_dilation, dn, fgc, bgc)


def _dilated(size: int, dilation: int) -> int:
    return 0 if size == 0 else (size - 1) * dilation + 1


def _swap01(spec: Sequence[int]) -> tuple[int, ...]:
    return (spec[1], spec[0], *spec[2:])


def _dlhs_conv(conv: _Conv, lhs_shape, rhs_shape, g_shape) -> tuple[_Conv, tuple[int, ...]]:
    """The convolution giving the lhs gradient from (g, kernel flipped in space), and the
    kernel's spatial axes (to flip)."""
    dn = conv.dn
    pads = []
    for i, (lo, _) in enumerate(conv.padding):
        size_in = _dilated(lhs_shape[dn.lhs_spec[2 + i]], conv.lhs_dilation[i])
        window = _dilated(rhs_shape[dn.rhs_spec[2 + i]], conv.rhs_dilation[i])
        size_out = _dilated(g_shape[dn.out_spec[2 + i]], conv.window_strides[i])
        before = window - 1 - lo
        pads.append((before, size_in + window - 1 - size_out - before))
    dims = jax.lax.ConvDimensionNumbers(dn.out_spec, _swap01(dn.rhs_spec), dn.lhs_spec)
    out = _Conv(conv.lhs_dilation, tuple(pads), conv.window_strides, conv.rhs_dilation, dims, 1, 1)
    return out, tuple(dn.rhs_spec[2:])


def _drhs_conv(conv: _Conv, lhs_shape, rhs_shape, g_shape) -> _Conv:
    """The convolution giving the kernel gradient from (lhs, g)."""
    dn = conv.dn
    pads = []
    for i, (lo, _) in enumerate(conv.padding):
        size_in = _dilated(lhs_shape[dn.lhs_spec[2 + i]], conv.lhs_dilation[i])
        window = _dilated(rhs_shape[dn.rhs_spec[2 + i]], conv.rhs_dilation[i])
        size_out = _dilated(g_shape[dn.out_spec[2 + i]], conv.window_strides[i])
        pads.append((lo, size_out - size_in + window - lo - 1))
    dims = jax.lax.ConvDimensionNumbers(
        _swap01(dn.lhs_spec), _swap01(dn.out_spec), _swap01(dn.rhs_spec)
    )
    return _Conv(conv.rhs_dilation, tuple(pads), conv.lhs_dilation, conv.window_strides, dims, 1, 1)


def _along(scale: jax.Array, scale_axis: int, ndim: int, axis: int) -> jax.Array:
    """A scale varying along its ``scale_axis`` only, laid along ``axis`` of an ndim array."""
    shape = [1] * ndim
    shape[axis] = scale.shape[scale_axis]
    return scale.reshape(shape)


def _quantize_g(g, y, scale_axis, g_axis, qtype, method, per_tensor, channel_axis):
    """(g quantized with one scale per index of ``channel_axis``, y): y's scale (along its
    ``scale_axis``) moved onto g's ``g_axis`` first, y then its unit-scaled codes."""
    if isinstance(y, qarray.QArray):
        if y.zero_point is None:
            g = g * _along(y.scale, scale_axis, g.ndim, g_axis).astype(g.dtype)
            y = qt_products.unit_scaled(y.qvalue, g.dtype)
        else:
            y = qarray.dequantize(y)
    how = qarray.HowToQuantize(
        qtype=qtype, channelwise_axes=(channel_axis,), calibration_method=method
    )
    return qarray.quantize(g, qt_products.per_tensor_if(how, per_tensor)), y


def _flip(x: Any, axes: tuple[int, ...]) -> Any:
    if isinstance(x, qarray.QArray):  # scales are constant in space
        return x.replace(qvalue=jax.lax.rev(x.qvalue, axes))
    return jax.lax.rev(x, axes)


def _as_float(x: Any) -> jax.Array:
    return qarray.dequantize(x) if isinstance(x, qarray.QArray) else x


def _grads(conv: _Conv, config, lhs, rhs, shapes, g) -> tuple[jax.Array, jax.Array]:
    """The lhs and kernel gradients by the two transposed convolutions (see the module)."""
    dn = conv.dn
    lhs_shape, rhs_shape = shapes
    quantize = numerics_api.should_quantize(g.dtype)
    dlhs_conv, flip_axes = _dlhs_conv(conv, lhs_shape, rhs_shape, g.shape)
    g_l, kernel = g, rhs
    if config.dlhs_grad_qtype is not None and quantize:
        g_l, kernel = _quantize_g(
            g,
            rhs,
            dn.rhs_spec[0],
            dn.out_spec[1],
            config.dlhs_grad_qtype,
            config.dlhs_grad_calibration_method,
            config.dlhs_grad_disable_channelwise_axes,
            dn.out_spec[0],
        )
    dlhs = dlhs_conv(g_l, _flip(kernel, flip_axes))
    g_r, inputs = g, lhs
    if config.drhs_grad_qtype is not None and quantize:
        g_r, inputs = _quantize_g(
            g,
            lhs,
            dn.lhs_spec[0],
            dn.out_spec[0],
            config.drhs_grad_qtype,
            config.drhs_grad_calibration_method,
            config.drhs_grad_disable_channelwise_axes,
            dn.out_spec[1],
        )
    drhs = _drhs_conv(conv, lhs_shape, rhs_shape, g.shape)(inputs, g_r)
    return dlhs, drhs


def _grads_grouped(conv: _Conv, config, lhs, rhs, g) -> tuple[jax.Array, jax.Array]:
    """Grouped convolutions: JAX's transposes of the float op, g quantized per batch item /
    output feature (no scale shift: the codes are not convolved natively here)."""
    dn = conv.dn
    _, vjp = jax.vjp(conv, _as_float(lhs), _as_float(rhs))
    sides = (
        (config.dlhs_grad_qtype, config.dlhs_grad_calibration_method, dn.out_spec[0], "dlhs"),
        (config.drhs_grad_qtype, config.drhs_grad_calibration_method, dn.out_spec[1], "drhs"),
    )
    out = []
    for index, (qtype, method, axis, prefix) in enumerate(sides):
        gq = g
        if qtype is not None and numerics_api.should_quantize(g.dtype):
            how = qarray.HowToQuantize(
                qtype=qtype, channelwise_axes=(axis,), calibration_method=method
            )
            per_tensor = getattr(config, f"{prefix}_grad_disable_channelwise_axes")
            how = qt_products.per_tensor_if(how, per_tensor)
            gq = qarray.dequantize(qarray.quantize(g, how))
        out.append(vjp(gq.astype(g.dtype))[index])
    return out[0], out[1]


def _calibration(x: jax.Array, conv: _Conv, config, for_lhs: bool) -> Any:
    """x's own calibration as the config quantizes it (None: not quantized)."""
    prefix = "lhs" if for_lhs else "rhs"
    qtype = getattr(config, f"{prefix}_qtype")
    if qtype is None or not numerics_api.should_quantize(x.dtype):
        return None
    how = conv_general_lib.get_how_to_quantize(
        dimension_numbers=conv.dn,
        for_lhs=for_lhs,
        qtype=qtype,
        calibration_method=getattr(config, f"{prefix}_calibration_method"),
    )
    how = qt_products.per_tensor_if(how, getattr(config, f"{prefix}_disable_channelwise_axes"))
    return qarray.calibrate(jax.lax.stop_gradient(x), how)


@interception.disable_interceptions
def _fwd(lhs, rhs, lhs_calibration, rhs_calibration, conv: _Conv, config):
    ql = qt_products.quantize_with_calibration(lhs, lhs_calibration, config.lhs_qtype)
    qr = qt_products.quantize_with_calibration(rhs, rhs_calibration, config.rhs_qtype)
    return conv(ql, qr), (ql, qr)


def _bwd(conv: _Conv, config, residuals, g):
    # A quantized operand's dtype is its scale's: the operand's own.
    ql, qr = residuals
    if conv.feature_group_count == 1 and conv.batch_group_count == 1:
        dlhs, drhs = _grads(conv, config, ql, qr, (ql.shape, qr.shape), g)
    else:
        dlhs, drhs = _grads_grouped(conv, config, ql, qr, g)
    return dlhs.astype(ql.dtype), drhs.astype(qr.dtype), None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _conv_qt(lhs, rhs, lhs_calibration, rhs_calibration, conv: _Conv, config):
    return _fwd(lhs, rhs, lhs_calibration, rhs_calibration, conv, config)[0]


_conv_qt.defvjp(_fwd, _bwd)


def conv_general_qt_fwd_bwd(
    lhs: jax.Array,
    rhs: jax.Array,
    lhs_calibration: dict[str, jax.Array] | None,
    rhs_calibration: dict[str, jax.Array] | None,
    config: ConvGeneralQtConfig,
    window_strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: Any = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
) -> jax.Array:
    """conv_general_qt with the operands' calibrations given (None: that side stays as it is),
    e.g. static ranges; the calibrations get no gradient."""
    conv = _conv(
        lhs.shape,
        rhs.shape,
        window_strides,
        padding,
        lhs_dilation,
        rhs_dilation,
        dimension_numbers,
        feature_group_count,
        batch_group_count,
    )
    return _conv_qt(lhs, rhs, lhs_calibration, rhs_calibration, conv, config)


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
    conv = _conv(
        lhs.shape,
        rhs.shape,
        window_strides,
        padding,
        lhs_dilation,
        rhs_dilation,
        dimension_numbers,
        feature_group_count,
        batch_group_count,
    )
    cal_l, cal_r = (_calibration(x, conv, config, s) for x, s in ((lhs, True), (rhs, False)))
    return _conv_qt(lhs, rhs, cal_l, cal_r, conv, config)
