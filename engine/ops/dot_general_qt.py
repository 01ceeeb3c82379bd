"""dot_general for quantized training (QT): quantized forward and backward passes.

Forward: each side with a qtype is quantized (with the calibration given, or its own: per channel
on its free axes, ``tile_size`` tiling the last contracting axis) and the product runs on the
QArrays through ops.dot_general: integer codes multiplied natively (int8 × int8 → int32, fp8
likewise) and both scales applied to the output.

Backward: each operand's gradient is the output gradient g contracted with the other operand
(the residual) over the residual's free axes. The residual is that operand as the forward pass
quantized it, unless ``use_original_residuals``, or unless its scales vary along an axis the
backward dot keeps (tiles, mx / nv blocks, per-element scales on a contracting axis): then it is
the operand as given, quantized by the ``*_residual_*`` fields when they ask for it.

With a grad qtype for that gradient, the quantized residual's scale (constant along its
contracting axes, so it lies on g's axes) is multiplied into g first, and the residual enters
the backward dot as its bare codes; g is then quantized with one scale per index of the axes the
backward dot keeps (optionally tiled along the last axis it contracts, ``d*_tile_size``, with
optional stochastic rounding). Both scales thus factor out of the contraction and the backward
dot multiplies codes natively as well, its output scaled by g's scale. Without a grad qtype g
stays in floating point and the residual is dequantized.

Gradients are zeroed where an operand fell outside the range its calibration kept (unless
``disable_gradient_clipping``; absmax / minmax keep everything). The calibrations get none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.core import numerics_api, qarray, qtypes, sparsity
from qmill.engine.modeling import interception
from qmill.engine.ops import dot_general as dot_general_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class DotGeneralQtConfig:
    """How dot_general_qt quantizes each side, forward and backward (qtype None: not at all)."""

    # Forward pass: the operands, as PTQ's dot_general would (per channel, tile_size tiles the
    # contracting axes).
    lhs_qtype: Any = None
    rhs_qtype: Any = None
    tile_size: int | float | None = None
    lhs_calibration_method: str = "absmax"
    rhs_calibration_method: str = "absmax"
    # One scale for the whole operand instead of one per channel.
    lhs_disable_channelwise_axes: bool = False
    rhs_disable_channelwise_axes: bool = False
    # Backward pass: the output gradient, as used for the lhs gradient.
    dlhs_grad_qtype: Any = None
    dlhs_grad_calibration_method: str = "absmax"
    # Tile size along the last axis the lhs gradient contracts (None: one scale along it).
    dlhs_tile_size: int | float | None = None
    # Stochastic rounding noise (stochastic_rounding.get_noise_fn).
    dlhs_stochastic_rounding_noise_fn: Callable[..., jax.Array] | None = None
    dlhs_grad_disable_channelwise_axes: bool = False
    # The same for the output gradient as used for the rhs gradient.
    drhs_grad_qtype: Any = None
    drhs_grad_calibration_method: str = "absmax"
    drhs_tile_size: int | float | None = None
    drhs_stochastic_rounding_noise_fn: Callable[..., jax.Array] | None = None
    drhs_grad_disable_channelwise_axes: bool = False
    # As the reference: the operands' gradients are zeroed where the operand fell outside the
    # range its calibration kept ("absmax,0.8", "fixed,-1,1", ...; absmax / minmax keep all of
    # it, so nothing is masked). True passes every gradient straight through.
    disable_gradient_clipping: bool = False
    # The backward pass reads the operands as given instead of their quantized forms.
    use_original_residuals: bool = False
    # How the backward pass quantizes an operand it reads as given (see the module): the rhs
    # for the lhs gradient (dlhs_residual_*), the lhs for the rhs gradient (drhs_residual_*).
    dlhs_residual_qtype: Any = None
    dlhs_residual_calibration_method: str = "absmax"
    dlhs_residual_disable_channelwise_axes: bool = False
    drhs_residual_qtype: Any = None
    drhs_residual_calibration_method: str = "absmax"
    drhs_residual_disable_channelwise_axes: bool = False
    # N:M sparsity of the rhs (a sparsity.SparsityRule's weight settings), applied before it is
    # quantized; pruned weights get no gradient.
    sparsity_rule: sparsity.SparsityRule | None = None

    def __hash__(self) -> int:
        # A static jit argument, as the reference's: a 2-D tile_size dict hashes as its items.
        return hash(tuple(_hashable(getattr(self, f.name)) for f in dataclasses.fields(self)))


def _hashable(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted(value.items()))
    return tuple(value) if isinstance(value, list) else value


# A pytree, as the reference's: the noise functions (whose keys are arrays) are its children, so
# a config can be passed through jit; every other field is static.
_NOISE_FIELDS = ("dlhs_stochastic_rounding_noise_fn", "drhs_stochastic_rounding_noise_fn")
jax.tree_util.register_dataclass(
    DotGeneralQtConfig,
    data_fields=list(_NOISE_FIELDS),
    meta_fields=[
        f.name for f in dataclasses.fields(DotGeneralQtConfig) if f.name not in _NOISE_FIELDS
    ],
)


def per_tensor_if(how: qarray.HowToQuantize, per_tensor: bool) -> qarray.HowToQuantize:
    """``how`` with one scale for the whole tensor (its tiles kept) when ``per_tensor``."""
    return dataclasses.replace(how, channelwise_axes=()) if per_tensor else how


def forward_hows(
    config: Any, get_how: Callable[..., qarray.HowToQuantize]
) -> list[qarray.HowToQuantize | None]:
    """The lhs / rhs forward quantization of a QT config: ``get_how(for_lhs=, qtype=,
    calibration_method=)`` per side with a qtype (None without), made per tensor where the
    config's *_disable_channelwise_axes says so."""
    hows = []
    for for_lhs, prefix in ((True, "lhs"), (False, "rhs")):
        qtype = getattr(config, f"{prefix}_qtype")
        if qtype is None:
            hows.append(None)
            continue
        how = get_how(
            for_lhs=for_lhs,
            qtype=qtype,
            calibration_method=getattr(config, f"{prefix}_calibration_method"),
        )
        hows.append(per_tensor_if(how, getattr(config, f"{prefix}_disable_channelwise_axes")))
    return hows


def quantize_with_calibration(x: jax.Array, calibration, qtype: Any) -> Any:
    """x quantized to ``qtype`` with the scale (and zero point) ``calibration`` gives, the
    scale in x's dtype (a static statistic is float32); x itself when calibration is None."""
    if calibration is None:
        return x
    scale, zero_point = qarray.compute_scale_zero_point(calibration, qtype)
    return qarray.quantize_with_scale_zero_point(
        jax.lax.stop_gradient(x), qtype, scale.astype(x.dtype), zero_point
    )


def unit_scaled(codes: jax.Array, qtype: Any, dtype: Any) -> qarray.QArray:
    """Bare codes as a QArray with scale 1 (their own scale was moved onto the other operand),
    so ops multiply them natively with a quantized other side."""
    return qarray.QArray(codes, jnp.ones((1,) * codes.ndim, dtype), None, qtype)


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
    to the output) when both sides may (see _native), else on the dequantized values."""
    if not (_native(lhs, dims[0][0]) and _native(rhs, dims[0][1])):
        lhs, rhs = (qarray.dequantize(x) if isinstance(x, qarray.QArray) else x for x in (lhs, rhs))
    return dot_general_lib.dot_general(lhs, rhs, dims, scales_in_result_dtype=True)


# ---- the backward dots -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Backward:
    """One operand's gradient x̄ = g · y: its dimension numbers and how g's axes map onto y's."""

    dims: tuple  # dot_general(g, y) dimension numbers
    transpose: tuple[int, ...]  # from that dot's output to x's axis order
    y_kept: tuple[int, ...]  # y's axes in the output (y's forward-contracting axes)
    g_to_y: tuple[int | None, ...]  # for each axis of g, the axis of y it pairs with (or None)


def _backward(dimension_numbers, ndims, for_dlhs: bool) -> _Backward:
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
    return _Backward(dims, tuple(int(i) for i in np.argsort(produced)), y_kept, tuple(g_to_y))


def _scale_onto_g(g: jax.Array, scale: jax.Array, bwd: _Backward) -> jax.Array:
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


def _operand_grad(g: jax.Array, y: Any, side: GradSide, bwd: _Backward) -> jax.Array:
    """g · y for one operand's gradient (see the module)."""
    quantize_g = side.grad_qtype is not None and numerics_api.should_quantize(g.dtype)
    if quantize_g and shiftable(y, bwd.y_kept):
        g = _scale_onto_g(g, y.scale, bwd)
        y = unit_scaled(y.qvalue, y.qtype, g.dtype)
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


def _residual(config: Any, given: jax.Array, quantized: Any) -> Any:
    """What the backward pass reads of an operand: its quantized form, unless the config asks
    for the operand as given or the forward scales are tiled (mx / nv blocks included), their
    blocks running along an axis the backward dot keeps."""
    if config.use_original_residuals:
        return given
    if isinstance(quantized, qarray.QArray) and (
        qtypes.get(quantized.qtype).required_tile is not None or qarray.get_tiled_axes(quantized)
    ):
        return given
    return quantized


def clip_gradients(config: Any, grads, operands, calibrations) -> tuple[jax.Array, ...]:
    """Each gradient zeroed where its operand fell outside its calibrated range, cast to the
    operand's dtype (see DotGeneralQtConfig.disable_gradient_clipping)."""
    out = []
    for grad, x, cal, prefix in zip(grads, operands, calibrations, ("lhs", "rhs"), strict=True):
        method = getattr(config, f"{prefix}_calibration_method")
        if cal is not None and not config.disable_gradient_clipping:
            grad = qarray.clip_gradient_to_calibration(grad, x, cal, method)
        out.append(grad.astype(x.dtype))
    return tuple(out)


# ---- the op ------------------------------------------------------------------------------------


@interception.disable_interceptions
def _fwd(lhs, rhs, lhs_calibration, rhs_calibration, dimension_numbers, config):
    ql = quantize_with_calibration(lhs, lhs_calibration, config.lhs_qtype)
    qr = quantize_with_calibration(rhs, rhs_calibration, config.rhs_qtype)
    out = qt_dot(ql, qr, dimension_numbers)
    res_l, res_r = _residual(config, lhs, ql), _residual(config, rhs, qr)
    return out, ((lhs, rhs), (res_l, res_r), (lhs_calibration, rhs_calibration), config)


def _bwd(dimension_numbers, residuals, g):
    (lhs, rhs), (res_l, res_r), calibrations, config = residuals
    ndims = (lhs.ndim, rhs.ndim)
    dlhs = _operand_grad(
        g, res_r, GradSide.of(config, "dlhs"), _backward(dimension_numbers, ndims, True)
    )
    drhs = _operand_grad(
        g, res_l, GradSide.of(config, "drhs"), _backward(dimension_numbers, ndims, False)
    )
    grads = clip_gradients(config, (dlhs, drhs), (lhs, rhs), calibrations)
    return (*grads, None, None, None)


def _dot_general_qt_fwd_bwd(lhs, rhs, lhs_calibration, rhs_calibration, dimension_numbers, config):
    return _fwd(lhs, rhs, lhs_calibration, rhs_calibration, dimension_numbers, config)[0]


_vjp = jax.custom_vjp(_dot_general_qt_fwd_bwd, nondiff_argnums=(4,))
_vjp.defvjp(
    lambda lhs, rhs, cl, cr, dn, config: _fwd(lhs, rhs, cl, cr, dn, config),
    _bwd,
)


def dot_general_qt_fwd_bwd(
    lhs: jax.Array,
    rhs: jax.Array,
    lhs_calibration: dict[str, jax.Array] | None,
    rhs_calibration: dict[str, jax.Array] | None,
    dimension_numbers: jax.lax.DotDimensionNumbers,
    config: DotGeneralQtConfig,
) -> jax.Array:
    """dot_general_qt with the operands' calibrations given (the reference's custom-VJP entry,
    e.g. for static ranges): a side with a calibration is quantized to its qtype with the scale
    it gives, a side with None stays as it is; the backward pass is the module's, the gradients
    clipped to the given calibrations. The calibrations get no gradient."""
    dims = normalize(dimension_numbers, lhs.ndim, rhs.ndim)
    return _vjp(lhs, rhs, lhs_calibration, rhs_calibration, dims, config)


def normalize(dimension_numbers, lhs_ndim: int, rhs_ndim: int) -> tuple:
    """Dimension numbers as tuples of non-negative ints (a hashable, static form)."""
    (lc, rc), (lb, rb) = dimension_numbers
    norm = lambda axes, n: tuple(int(a) % n for a in np.atleast_1d(axes))  # noqa: E731
    return (norm(lc, lhs_ndim), norm(rc, rhs_ndim)), (norm(lb, lhs_ndim), norm(rb, rhs_ndim))


def dot_general_qt(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: jax.lax.DotDimensionNumbers,
    config: DotGeneralQtConfig,
) -> jax.Array:
    """jax.lax.dot_general with QT's quantized forward and backward passes (see the module)."""
    dims = normalize(dimension_numbers, lhs.ndim, rhs.ndim)

    def get(**kwargs):
        return dot_general_lib.get_how_to_quantize(
            dimension_numbers=dims, ndims=(lhs.ndim, rhs.ndim), tile_size=config.tile_size, **kwargs
        )

    if config.sparsity_rule is not None:
        # Before quantization, as the reference: the kept weights get the whole range.
        rhs = sparsity.sparsify(rhs, config.sparsity_rule)
    calibrations = [
        None
        if how is None or not numerics_api.should_quantize(x.dtype)
        else qarray.calibrate(jax.lax.stop_gradient(x), how)
        for x, how in zip((lhs, rhs), forward_hows(config, get), strict=True)
    ]
    return _vjp(lhs, rhs, *calibrations, dims, config)
