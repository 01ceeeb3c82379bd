"""The products of quantized training (QT), shared by dot_general_qt and conv_general_qt: how
a product runs on quantized operands (on their codes, as the reference chooses), and the
backward products of dot_general, whose output gradient takes the other operand's scale so that
operand enters as its codes (see dot_general_qt's module docstring).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.core import numerics_api, qarray
from qmill.engine.ops import dot_general as dot_general_lib


def per_tensor_if(how: qarray.HowToQuantize, per_tensor: bool) -> qarray.HowToQuantize:
    """``how`` with one scale for the whole tensor (its tiles kept) when ``per_tensor``."""
    return dataclasses.replace(how, channelwise_axes=()) if per_tensor else how


def quantize_with_calibration(x: jax.Array, calibration, qtype: Any) -> Any:
    """x quantized to ``qtype`` with the scale (and zero point) ``calibration`` gives, the
    scale in x's dtype (a static statistic is float32); x itself when calibration is None."""
    if calibration is None:
        return x
    scale, zero_point = qarray.compute_scale_zero_point(calibration, qtype)
    return qarray.quantize_with_scale_zero_point(
        jax.lax.stop_gradient(x), qtype, scale.astype(x.dtype), zero_point
    )


def unit_scaled(codes: jax.Array, dtype: Any) -> qarray.QArray:
    """Bare codes (their qtype their dtype's) as a QArray with scale 1 in ``dtype`` (their own
    scale was moved onto the other operand), so ops multiply them natively with a quantized
    other side."""
    return qarray.QArray(codes, jnp.ones((1,) * codes.ndim, dtype))


def shiftable(x: Any, kept_axes: tuple[int, ...]) -> bool:
    """Whether x is a QArray whose scale may move onto the output gradient: symmetric, and
    constant along ``kept_axes`` (the axes of x the backward op keeps in its output)."""
    return (
        isinstance(x, qarray.QArray)
        and x.zero_point is None
        and all(x.scale.shape[a] == 1 for a in kept_axes)
    )


# The reference's threshold: a contracting axis tiled finer than this is dequantized before the
# product (a scaled product per tile would cost more than the float one).
MIN_TILE_TO_SCALE_OUTPUT = 128


def _native(x: Any, contracting: tuple[int, ...]) -> bool:
    """Whether x may enter a product as codes: a QArray of uniform levels whose scale along the
    contracting axes is one or tiles of at least MIN_TILE_TO_SCALE_OUTPUT, or bare codes."""
    if not isinstance(x, qarray.QArray):
        return not numerics_api.should_quantize(x.dtype)
    return numerics_api.can_dequant_on_output(x.qtype) and all(
        x.scale.shape[a] == 1 or x.shape[a] // x.scale.shape[a] >= MIN_TILE_TO_SCALE_OUTPUT
        for a in contracting
    )


def qt_dot(lhs: Any, rhs: Any, dims: tuple) -> jax.Array:
    """ops.dot_general, as the reference chooses between its paths: on the codes (scales applied
    to the output; bare codes as unit-scaled) when both sides may (see _native), else on the
    dequantized values (bare codes as they are)."""
    if not (_native(lhs, dims[0][0]) and _native(rhs, dims[0][1])):
        lhs, rhs = (qarray.dequantize(x) if isinstance(x, qarray.QArray) else x for x in (lhs, rhs))
    elif isinstance(rhs, qarray.QArray) and not isinstance(lhs, qarray.QArray):
        lhs = unit_scaled(lhs, rhs.scale.dtype)
    elif isinstance(lhs, qarray.QArray) and not isinstance(rhs, qarray.QArray):
        rhs = unit_scaled(rhs, lhs.scale.dtype)
    return dot_general_lib.dot_general(lhs, rhs, dims, scales_in_result_dtype=True)


# ---- the backward dots -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Backward:
    """One operand's gradient x̄ = g · y: its dimension numbers and how g's axes map onto y's."""

    dims: tuple  # dot_general(g, y) dimension numbers
    transpose: tuple[int, ...]  # from that dot's output to x's axis order
    y_kept: tuple[int, ...]  # y's axes in the output (y's forward-contracting axes)
    g_to_y: tuple[int | None, ...]  # for each axis of g, the axis of y it pairs with (or None)


def backward(dimension_numbers, ndims, for_dlhs: bool) -> Backward:
    """x̄ = g · y with x the lhs (for_dlhs) or the rhs. g's axes are (batch, lhs free, rhs free);
    the dot contracts g's y-free axes with y's free axes and pairs the batch axes; its output is
    (batch, x free, y's forward-contracting axes in y's order), transposed back to x's order."""
    (lc, rc), (lb, rb) = dimension_numbers
    x_c, y_c, x_b, y_b = (lc, rc, lb, rb) if for_dlhs else (rc, lc, rb, lb)
    x_nd, y_nd = ndims if for_dlhs else ndims[::-1]
    x_free = [a for a in range(x_nd) if a not in x_c and a not in x_b]
    y_free = [a for a in range(y_nd) if a not in y_c and a not in y_b]
    nb = len(x_b)
    n_lhs_free = len(x_free) if for_dlhs else len(y_free)
    lhs_free_pos = list(range(nb, nb + n_lhs_free))
    rhs_free_pos = list(range(nb + n_lhs_free, nb + len(x_free) + len(y_free)))
    y_pos = rhs_free_pos if for_dlhs else lhs_free_pos
    dims = ((tuple(y_pos), tuple(y_free)), (tuple(range(nb)), tuple(y_b)))
    y_kept = tuple(sorted(y_c))
    produced = [*x_b, *x_free, *(x_c[list(y_c).index(a)] for a in y_kept)]
    g_to_y: list[int | None] = [None] * (nb + len(x_free) + len(y_free))
    for i, a in enumerate(y_b):
        g_to_y[i] = a
    for p, a in zip(y_pos, y_free, strict=True):
        g_to_y[p] = a
    return Backward(dims, tuple(int(i) for i in np.argsort(produced)), y_kept, tuple(g_to_y))


def _scale_onto_g(g: jax.Array, scale: jax.Array, bwd: Backward) -> jax.Array:
    """g times the residual's scale, laid out along g's axes (size 1 on y's kept axes)."""
    kept = [a for a in range(scale.ndim) if a not in bwd.g_to_y]
    s = jnp.squeeze(scale, axis=tuple(kept)) if kept else scale
    order = [a for a in bwd.g_to_y if a is not None]
    # After the squeeze, axes keep their relative order.
    remaining = [a for a in range(scale.ndim) if a not in kept]
    s = jnp.transpose(s, [remaining.index(a) for a in order])
    shape = [1 if a is None else scale.shape[a] for a in bwd.g_to_y]
    return g * s.reshape(shape).astype(g.dtype)


@dataclasses.dataclass(frozen=True)
class GradSide:
    """How one operand's gradient quantizes g (grad_*) and a residual read as given
    (residual_*)."""

    grad_qtype: Any
    grad_calibration_method: str
    tile_size: Any
    noise_fn: Any
    grad_per_tensor: bool
    residual_qtype: Any = None
    residual_calibration_method: str = "absmax"
    residual_per_tensor: bool = False

    @classmethod
    def of(cls, config: Any, prefix: str) -> GradSide:
        """The ``prefix`` ("dlhs" / "drhs") fields of a QT config (absent ones: None)."""
        get = lambda name, default=None: getattr(config, f"{prefix}_{name}", default)  # noqa: E731
        return cls(
            get("grad_qtype"),
            get("grad_calibration_method", "absmax"),
            get("tile_size"),
            get("stochastic_rounding_noise_fn"),
            get("grad_disable_channelwise_axes", False),
            get("residual_qtype"),
            get("residual_calibration_method", "absmax"),
            get("residual_disable_channelwise_axes", False),
        )


def operand_grad(g: jax.Array, y: Any, side: GradSide, bwd: Backward) -> jax.Array:
    """g · y for one operand's gradient (see the module)."""
    quantize_g = side.grad_qtype is not None and numerics_api.should_quantize(g.dtype)
    if quantize_g and shiftable(y, bwd.y_kept):
        g = _scale_onto_g(g, y.scale, bwd)
        y = y.qvalue
    elif isinstance(y, qarray.QArray) and quantize_g:
        y = qarray.dequantize(y)
    get = dict(dimension_numbers=bwd.dims, ndims=(g.ndim, y.ndim), tile_size=side.tile_size)
    if quantize_g:
        how = dot_general_lib.get_how_to_quantize(
            for_lhs=True,
            qtype=side.grad_qtype,
            calibration_method=side.grad_calibration_method,
            **get,
        )
        how = dataclasses.replace(how, noise_fn=side.noise_fn)
        g = qarray.quantize(g, per_tensor_if(how, side.grad_per_tensor))
    if (
        side.residual_qtype is not None
        and not isinstance(y, qarray.QArray)
        and numerics_api.should_quantize(y.dtype)
    ):
        how = dot_general_lib.get_how_to_quantize(
            for_lhs=False,
            qtype=side.residual_qtype,
            calibration_method=side.residual_calibration_method,
            **get,
        )
        y = qarray.quantize(y, per_tensor_if(how, side.residual_per_tensor))
    return jnp.transpose(qt_dot(g, y, bwd.dims), bwd.transpose)
