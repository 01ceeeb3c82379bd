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
import numpy as np

from qmill.engine.core import numerics_api, qarray, qtypes, sparsity
from qmill.engine.modeling import interception
from qmill.engine.ops import dot_general as dot_general_lib
from qmill.engine.ops import qt_products
from qmill.engine.ops.qt_products import per_tensor_if as per_tensor_if
from qmill.engine.ops.qt_products import (
    quantize_with_calibration as quantize_with_calibration,
)


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
        hows.append(
            qt_products.per_tensor_if(how, getattr(config, f"{prefix}_disable_channelwise_axes"))
        )
    return hows


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
def dot_general_qt_fwd(
    lhs: jax.Array,
    rhs: jax.Array,
    lhs_calibration: dict[str, jax.Array] | None,
    rhs_calibration: dict[str, jax.Array] | None,
    dimension_numbers: jax.lax.DotDimensionNumbers,
    config: DotGeneralQtConfig,
) -> tuple[jax.Array, Any]:
    """The forward pass of dot_general_qt_fwd_bwd: (output, residuals for the backward pass)."""
    dims = normalize(dimension_numbers, lhs.ndim, rhs.ndim)
    ql = qt_products.quantize_with_calibration(lhs, lhs_calibration, config.lhs_qtype)
    qr = qt_products.quantize_with_calibration(rhs, rhs_calibration, config.rhs_qtype)
    out = qt_products.qt_dot(ql, qr, dims)
    res_l, res_r = _residual(config, lhs, ql), _residual(config, rhs, qr)
    return out, ((lhs, rhs), (res_l, res_r), (lhs_calibration, rhs_calibration), config)


def dot_general_qt_bwd(
    fwd_dimension_numbers: jax.lax.DotDimensionNumbers, residuals: Any, g: jax.Array
) -> tuple[Any, ...]:
    """The backward pass of dot_general_qt_fwd_bwd: the gradients of (lhs, rhs, lhs_calibration,
    rhs_calibration, config), the last three None."""
    (lhs, rhs), (res_l, res_r), calibrations, config = residuals
    ndims = (lhs.ndim, rhs.ndim)
    dims = normalize(fwd_dimension_numbers, *ndims)
    dlhs = qt_products.operand_grad(
        g, res_r, qt_products.GradSide.of(config, "dlhs"), qt_products.backward(dims, ndims, True)
    )
    drhs = qt_products.operand_grad(
        g, res_l, qt_products.GradSide.of(config, "drhs"), qt_products.backward(dims, ndims, False)
    )
    grads = clip_gradients(config, (dlhs, drhs), (lhs, rhs), calibrations)
    return (*grads, None, None, None)


def _dot_general_qt_fwd_bwd(lhs, rhs, lhs_calibration, rhs_calibration, dimension_numbers, config):
    return dot_general_qt_fwd(
        lhs, rhs, lhs_calibration, rhs_calibration, dimension_numbers, config
    )[0]


_vjp = jax.custom_vjp(_dot_general_qt_fwd_bwd, nondiff_argnums=(4,))
_vjp.defvjp(dot_general_qt_fwd, dot_general_qt_bwd)


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
