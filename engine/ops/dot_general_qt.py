"""dot_general for quantized training: quantized forward, optionally quantized backward (QT).

Forward: each operand with a qtype is fake-quantized (quantized and dequantized) as the PTQ op
would quantize it, and the float op runs on the result; the gradient reaches the operands
straight through the rounding (STE). Backward: the output gradient g is fake-quantized once for
each operand's gradient when that side has a grad qtype. For dlhs (g contracted with rhs over
rhs's free axes) g gets a scale per index of its batch and lhs axes, optionally tiled along the
last contracted axis (``dlhs_tile_size``); for drhs likewise with the rhs axes. The residuals
are the fake-quantized operands, so the backward pass sees the values the forward pass used.

Residual quantization (``dlhs_residual_*`` / ``drhs_residual_*``, as the reference's): where the
backward pass would read an operand unquantized (``use_original_residuals``, no forward qtype on
that side, or a tiled / mx forward quantization, whose blocks run along the wrong axis for the
backward dot), it reads it quantized with the residual qtype instead, one scale per index of the
axes the backward dot keeps (tiled by that gradient's tile size along the axis it contracts).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from qmill.engine.core import qarray, qtypes, sparsity
from qmill.engine.modeling import interception
from qmill.engine.ops import dot_general as dot_general_lib
from qmill.engine.ops import op_adapter


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
    # Stochastic rounding noise (a HowToQuantize noise_fn), e.g. from qt.stochastic_noise_fn.
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
    # The backward pass uses the operands as given instead of their fake-quantized values.
    use_original_residuals: bool = False
    # How the backward pass quantizes an operand it reads unquantized (see the module): the rhs
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


@dataclasses.dataclass(frozen=True)
class GradQuant:
    """How one operand's gradient quantizes g: qtype None leaves it in floating point."""

    qtype: Any
    calibration_method: str
    tile_size: int | float | None
    noise_fn: Callable[..., jax.Array] | None
    per_tensor: bool


def fake_quant(x: jax.Array, how: qarray.HowToQuantize | None) -> jax.Array:
    """x quantized and dequantized (in x's dtype); x itself when ``how`` is None."""
    if how is None:
        return x
    return qarray.dequantize(qarray.quantize(x, how)).astype(x.dtype)


def _maybe_per_tensor(how: qarray.HowToQuantize, per_tensor: bool) -> qarray.HowToQuantize:
    return dataclasses.replace(how, channelwise_axes=()) if per_tensor else how


def quantize_grad(
    g: jax.Array, layout: op_adapter.GradLayout, side: str, quant: GradQuant
) -> jax.Array:
    """g fake-quantized for the gradient of operand ``side`` ("lhs" or "rhs")."""
    if quant.qtype is None:
        return g
    own = layout.lhs_free if side == "lhs" else layout.rhs_free
    contracted = layout.rhs_free if side == "lhs" else layout.lhs_free
    # The last axis g contracts, as the reference tiles it; mx / nv formats by their block.
    tile = quant.tile_size or qtypes.get(quant.qtype).required_tile
    tiled = {contracted[-1]: tile} if tile and contracted else {}
    how = qarray.HowToQuantize(
        qtype=quant.qtype,
        channelwise_axes=() if quant.per_tensor else (*layout.batch, *own),
        tiled_axes=tiled,
        calibration_method=quant.calibration_method,
        noise_fn=quant.noise_fn,
    )
    return fake_quant(g, how)


@dataclasses.dataclass(frozen=True)
class Residuals:
    """What the backward pass keeps of the forward pass (see qt_call)."""

    original: bool = False  # the operands as given instead of their fake-quantized values
    clip_gradients: bool = True  # zero gradients outside the operands' calibrated ranges

    @classmethod
    def of(cls, config: Any) -> Residuals:
        return cls(
            getattr(config, "use_original_residuals", False),
            not getattr(config, "disable_gradient_clipping", False),
        )


def _clips(how: qarray.HowToQuantize | None, keep: Residuals) -> bool:
    return (
        keep.clip_gradients
        and how is not None
        and not qarray.is_gradient_clipping_noop(how.calibration_method)
    )


def _clip(grad: jax.Array, x: jax.Array | None, how: qarray.HowToQuantize | None) -> jax.Array:
    """The operand's gradient zeroed where x fell outside the range its calibration kept (x is
    None where nothing is clipped)."""
    if x is None or how is None:
        return grad
    calibration = qarray.calibrate(x, how)
    return qarray.clip_gradient_to_calibration(grad, x, calibration, how.calibration_method)


def qt_call(
    op,
    layout,
    lhs_how,
    rhs_how,
    dlhs: GradQuant,
    drhs: GradQuant,
    lhs,
    rhs,
    keep=None,
    residual_hows=(None, None),
):
    """op(lhs, rhs) with the operands fake-quantized and the gradients quantized as given.

    ``keep`` (Residuals) says what the backward pass keeps; the default is the conv's: the
    fake-quantized operands, no gradient clipping. ``residual_hows``: (lhs as the rhs gradient
    reads it, rhs as the lhs gradient reads it), each quantized from the operand as given, or
    None for the residual ``keep`` says.
    """
    keep = keep or Residuals(clip_gradients=False)
    hows = (lhs_how, rhs_how)
    if residual_hows != (None, None):
        return _qt_call_quantized_residuals(
            op, layout, hows, dlhs, drhs, lhs, rhs, keep, residual_hows
        )

    @jax.custom_vjp
    def run(a, b):
        return op(fake_quant(a, lhs_how), fake_quant(b, rhs_how))

    @interception.disable_interceptions
    def fwd(a, b):
        qa, qb = fake_quant(a, lhs_how), fake_quant(b, rhs_how)
        # The operands as given are kept only where the backward pass reads them.
        clip = tuple(x if _clips(h, keep) else None for x, h in zip((a, b), hows, strict=True))
        operands = (a, b) if keep.original else (qa, qb)
        return op(qa, qb), (operands, clip)

    def bwd(residuals, g):
        operands, (a, b) = residuals
        _, vjp = jax.vjp(op, *operands)
        da, _ = vjp(quantize_grad(g, layout, "lhs", dlhs))
        _, db = vjp(quantize_grad(g, layout, "rhs", drhs))
        return _clip(da, a, lhs_how), _clip(db, b, rhs_how)

    run.defvjp(fwd, bwd)
    return run(lhs, rhs)


def _qt_call_quantized_residuals(op, layout, hows, dlhs, drhs, lhs, rhs, keep, residual_hows):
    """qt_call where at least one gradient reads a residual quantized on its own."""

    @jax.custom_vjp
    def run(a, b):
        return op(fake_quant(a, hows[0]), fake_quant(b, hows[1]))

    @interception.disable_interceptions
    def fwd(a, b):
        qa, qb = fake_quant(a, hows[0]), fake_quant(b, hows[1])
        clip = tuple(x if _clips(h, keep) else None for x, h in zip((a, b), hows, strict=True))
        operands = (a, b) if keep.original else (qa, qb)
        # The residuals each gradient reads: its own quantization of the operand as given.
        res_a = operands[0] if residual_hows[0] is None else fake_quant(a, residual_hows[0])
        res_b = operands[1] if residual_hows[1] is None else fake_quant(b, residual_hows[1])
        return op(qa, qb), ((operands[0], res_b), (res_a, operands[1]), clip)

    def bwd(residuals, g):
        for_da, for_db, (a, b) = residuals
        _, vjp_a = jax.vjp(op, *for_da)
        da, _ = vjp_a(quantize_grad(g, layout, "lhs", dlhs))
        _, vjp_b = jax.vjp(op, *for_db)
        _, db = vjp_b(quantize_grad(g, layout, "rhs", drhs))
        return _clip(da, a, hows[0]), _clip(db, b, hows[1])

    run.defvjp(fwd, bwd)
    return run(lhs, rhs)


def _backward_dimension_numbers(dimension_numbers, ndims, for_dlhs: bool):
    """The dot_general dimension numbers of one operand's gradient: g (the output gradient,
    axes batch, lhs free, rhs free) contracted with the other operand (the residual)."""
    (lhs_ca, rhs_ca), (lhs_ba, rhs_ba) = dimension_numbers
    lhs_free = [a for a in range(ndims[0]) if a not in lhs_ca and a not in lhs_ba]
    rhs_free = [a for a in range(ndims[1]) if a not in rhs_ca and a not in rhs_ba]
    batch = tuple(range(len(lhs_ba)))
    lhs_pos = tuple(range(len(batch), len(batch) + len(lhs_free)))
    rhs_pos = tuple(range(len(batch) + len(lhs_free), len(batch) + len(lhs_free) + len(rhs_free)))
    if for_dlhs:  # g · rhs over rhs's free axes
        return ((rhs_pos, tuple(rhs_free)), (batch, tuple(rhs_ba)))
    return ((lhs_pos, tuple(lhs_free)), (batch, tuple(lhs_ba)))


def _reads_unquantized(how: qarray.HowToQuantize | None, keep: Residuals) -> bool:
    """Whether the backward pass would read this operand as given (see the module)."""
    if keep.original or how is None:
        return True
    return bool(how.tiled_axes) or qtypes.get(how.qtype).required_tile is not None


def residual_hows(
    config: Any, dimension_numbers, ndims, hows, keep: Residuals
) -> tuple[qarray.HowToQuantize | None, qarray.HowToQuantize | None]:
    """(lhs for the rhs gradient, rhs for the lhs gradient) as the config's residual fields
    quantize them; None where no residual qtype applies."""
    out = []
    for operand, prefix, tile in ((0, "drhs", "drhs_tile_size"), (1, "dlhs", "dlhs_tile_size")):
        qtype = getattr(config, f"{prefix}_residual_qtype", None)
        if qtype is None or not _reads_unquantized(hows[operand], keep):
            out.append(None)
            continue
        dn = _backward_dimension_numbers(dimension_numbers, ndims, for_dlhs=prefix == "dlhs")
        n_batch = len(dimension_numbers[1][0])
        g_ndim = n_batch + sum(ndims[i] - len(dimension_numbers[0][i]) - n_batch for i in (0, 1))
        how = dot_general_lib.get_how_to_quantize(
            dimension_numbers=dn,
            ndims=(g_ndim, ndims[operand]),
            for_lhs=False,
            qtype=qtype,
            tile_size=getattr(config, tile),
            calibration_method=getattr(config, f"{prefix}_residual_calibration_method"),
        )
        per_tensor = getattr(config, f"{prefix}_residual_disable_channelwise_axes")
        out.append(_maybe_per_tensor(how, per_tensor))
    return out[0], out[1]


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
        hows.append(_maybe_per_tensor(how, getattr(config, f"{prefix}_disable_channelwise_axes")))
    return hows


def grad_quants(config: Any) -> tuple[GradQuant, GradQuant]:
    """The dlhs / drhs settings of a QT config (fields missing on conv configs are None)."""

    def side(prefix: str) -> GradQuant:
        return GradQuant(
            getattr(config, f"{prefix}_grad_qtype"),
            getattr(config, f"{prefix}_grad_calibration_method"),
            getattr(config, f"{prefix}_tile_size", None),
            getattr(config, f"{prefix}_stochastic_rounding_noise_fn", None),
            getattr(config, f"{prefix}_grad_disable_channelwise_axes"),
        )

    return side("dlhs"), side("drhs")


def _noop(method: str) -> bool:
    return qarray.is_gradient_clipping_noop(method)


def dot_general_qt_fwd_bwd(
    lhs: jax.Array,
    rhs: jax.Array,
    lhs_calibration: dict[str, jax.Array] | None,
    rhs_calibration: dict[str, jax.Array] | None,
    dimension_numbers: jax.lax.DotDimensionNumbers,
    config: DotGeneralQtConfig,
) -> jax.Array:
    """dot_general_qt with the operands' calibrations given (the reference's custom-VJP entry,
    e.g. for static ranges): a side with a calibration is fake-quantized to its qtype with the
    scale it gives, a side with None stays as it is; the backward pass is dot_general_qt's, the
    gradients clipped to the given calibrations. The calibrations get no gradient."""
    ndims = (lhs.ndim, rhs.ndim)
    layout = op_adapter.dot_general_grad_layout(dimension_numbers, ndims)
    keep = Residuals.of(config)
    dlhs, drhs = grad_quants(config)
    sides = (
        (config.lhs_qtype, config.lhs_calibration_method),
        (config.rhs_qtype, config.rhs_calibration_method),
    )

    def op(a, b):
        return jax.lax.dot_general(a, b, dimension_numbers)

    def quantized(x, calibration, side):
        if calibration is None:
            return x
        scale, zero_point = qarray.compute_scale_zero_point(calibration, sides[side][0])
        q = qarray.quantize_with_scale_zero_point(
            jax.lax.stop_gradient(x), sides[side][0], scale.astype(x.dtype), zero_point
        )
        return qarray.dequantize(q).astype(x.dtype)

    @jax.custom_vjp
    def run(a, b, cal_a, cal_b):
        return op(quantized(a, cal_a, 0), quantized(b, cal_b, 1))

    @interception.disable_interceptions
    def fwd(a, b, cal_a, cal_b):
        qa, qb = quantized(a, cal_a, 0), quantized(b, cal_b, 1)
        operands = (a, b) if keep.original else (qa, qb)
        return op(qa, qb), (operands, (a, b), (cal_a, cal_b))

    def bwd(residuals, g):
        operands, originals, calibrations = residuals
        _, vjp = jax.vjp(op, *operands)
        da, _ = vjp(quantize_grad(g, layout, "lhs", dlhs))
        _, db = vjp(quantize_grad(g, layout, "rhs", drhs))
        grads = []
        for grad, x, cal, (_, method) in zip((da, db), originals, calibrations, sides, strict=True):
            if cal is not None and keep.clip_gradients and not _noop(method):
                grad = qarray.clip_gradient_to_calibration(grad, x, cal, method)
            grads.append(grad)
        return grads[0], grads[1], None, None

    run.defvjp(fwd, bwd)
    return run(lhs, rhs, lhs_calibration, rhs_calibration)


def dot_general_qt(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: jax.lax.DotDimensionNumbers,
    config: DotGeneralQtConfig,
) -> jax.Array:
    """jax.lax.dot_general with QT's quantized forward and backward passes (see the module)."""
    ndims = (lhs.ndim, rhs.ndim)
    get = functools.partial(
        dot_general_lib.get_how_to_quantize,
        dimension_numbers=dimension_numbers,
        ndims=ndims,
        tile_size=config.tile_size,
    )
    hows = forward_hows(config, get)
    layout = op_adapter.dot_general_grad_layout(dimension_numbers, ndims)

    def op(a, b):
        return jax.lax.dot_general(a, b, dimension_numbers)

    if config.sparsity_rule is not None:
        # Before quantization, as the reference: the kept weights get the whole range.
        rhs = sparsity.sparsify(rhs, config.sparsity_rule)
    keep = Residuals.of(config)
    residuals = residual_hows(config, dimension_numbers, ndims, hows, keep)
    return qt_call(op, layout, hows[0], hows[1], *grad_quants(config), lhs, rhs, keep, residuals)
