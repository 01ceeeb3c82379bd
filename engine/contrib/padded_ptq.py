"""PTQ with tiles that need not divide their axis (the reference's contrib.padded_ptq).

Sub-channel quantization needs the tile to divide the axis (2880 channels in tiles of 256 do
not). Here the array is zero-padded up to a multiple of every tile first (zeros change no
absmax and add nothing to a product), quantized, and the padding dropped again from the codes
(unless QARRAY_KEEP_PADDED_SHAPE): a PaddedQArray keeps the scales of the padded array and both
shapes. Its dot_general / einsum pad the codes back, pad a float operand along the contracted
axes to match, and run the ordinary quantized op; PaddedPtqProvider is PtqProvider doing all of
this, and quantize_params quantizes a float checkpoint for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax
import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from qmill.engine.core import qarray
from qmill.engine.ops import dot_general as dot_general_lib
from qmill.engine.ops import einsum as einsum_lib
from qmill.engine.ops import op_adapter
from qmill.engine.providers import ptq as ptq_lib

PtqProvider = ptq_lib.PtqProvider
calibrate = qarray.calibrate
HowToQuantize = qarray.HowToQuantize

# True: a PaddedQArray's codes keep the padded shape (no slicing off and padding back).
QARRAY_KEEP_PADDED_SHAPE = False


@flax.struct.dataclass
class PaddedQArray(qarray.QArray):
    """A QArray of a zero-padded array: scale (and zero point) are the padded array's; qvalue
    has either shape. padded_shape: the shape after padding to whole tiles; original_shape: the
    array's own."""

    padded_shape: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())
    original_shape: tuple[int, ...] = flax.struct.field(pytree_node=False, default=())

    def __post_init__(self) -> None:
        qvalue = self.qvalue
        shape = tuple(getattr(qvalue, "shape", ()))
        if not self.padded_shape or not hasattr(qvalue, "dtype") or shape == self.padded_shape:
            super().__post_init__()
            return
        # Unpadded codes: checked as the padded array they stand for.
        padded = jax.ShapeDtypeStruct(self.padded_shape, qvalue.dtype)
        checked = qarray.QArray(padded, self.scale, self.zero_point, self.qtype)
        object.__setattr__(self, "qtype", checked.qtype)


nnx.register_data_type(PaddedQArray)

MaybeQArray = jax.Array | qarray.QArray | PaddedQArray


def pad_to_shape(array: jax.Array, target_shape: tuple[int, ...]) -> jax.Array:
    """``array`` zero-padded at the end of each axis up to ``target_shape``."""
    if tuple(array.shape) == tuple(target_shape):
        return array
    widths = [(0, target - size) for size, target in zip(array.shape, target_shape, strict=True)]
    return jnp.pad(array, widths, constant_values=0)


def get_padded_shape(
    original_shape: tuple[int, ...], tiled_axes: Mapping[int, int | float]
) -> tuple[int, ...]:
    """``original_shape`` with each tiled axis rounded up to a multiple of its tile. A float
    tile is a fraction of the axis (tile = round(size × fraction)), as in HowToQuantize; a tile
    that rounds to 0 leaves its axis alone."""
    shape = list(original_shape)
    for axis, tile in (tiled_axes or {}).items():
        size = original_shape[axis]
        tile = round(size * tile) if isinstance(tile, float) else int(tile)
        if tile > 0 and size % tile:
            shape[axis] = size + tile - size % tile
    return tuple(shape)


def quantize(array: jax.Array, how: HowToQuantize) -> PaddedQArray:
    """Quantizes ``array`` with dynamic scales, padded to whole tiles first."""
    original = tuple(array.shape)
    padded = get_padded_shape(original, dict(how.tiled_axes_dict))
    q = qarray.quantize(pad_to_shape(array, padded), how)
    qvalue = q.qvalue
    if not QARRAY_KEEP_PADDED_SHAPE:
        qvalue = qvalue[tuple(slice(0, size) for size in original)]
    return PaddedQArray(
        qvalue, q.scale, q.zero_point, q.qtype, padded_shape=padded, original_shape=original
    )


def dequantize(array: PaddedQArray) -> jax.Array:
    """The float array of ``array``, in its original shape."""
    out = qarray.dequantize(_padded(array))
    if tuple(out.shape) != tuple(array.original_shape):
        out = out[tuple(slice(0, size) for size in array.original_shape)]
    return out


def _padded(x: Any) -> Any:
    """A PaddedQArray as the plain QArray of its padded array; anything else as it is."""
    if isinstance(x, PaddedQArray):
        qvalue = pad_to_shape(x.qvalue, x.padded_shape)
        return qarray.QArray(qvalue, x.scale, x.zero_point, x.qtype)
    return x


def _match(x: Any, axes: list[int], sizes: list[int]) -> Any:
    """A float operand padded on its contracted axes to the other operand's (padded) sizes."""
    if isinstance(x, qarray.QArray):
        return x
    target = list(x.shape)
    for axis, size in zip(axes, sizes, strict=True):
        target[axis] = size
    return pad_to_shape(x, tuple(target))


def dot_general(
    lhs: MaybeQArray,
    rhs: MaybeQArray,
    dimension_numbers: jax.lax.DotDimensionNumbers,
    precision: jax.lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    **kwargs: Any,
) -> jax.Array:
    """The quantized dot_general of padded operands (see the module's docstring)."""
    lhs_padded, rhs_padded = _padded(lhs), _padded(rhs)
    (lhs_c, rhs_c), _ = dimension_numbers
    rhs_padded = _match(rhs_padded, list(rhs_c), [lhs_padded.shape[a] for a in lhs_c])
    lhs_padded = _match(lhs_padded, list(lhs_c), [rhs_padded.shape[a] for a in rhs_c])
    return dot_general_lib.dot_general(
        lhs_padded,
        rhs_padded,
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
        **kwargs,
    )


def einsum(
    einsum_str: str,
    lhs: MaybeQArray,
    rhs: MaybeQArray,
    *,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    **kwargs: Any,
) -> jax.Array:
    """The quantized einsum of padded operands (see the module's docstring)."""
    lhs_padded, rhs_padded = _padded(lhs), _padded(rhs)
    # Only the contracted axes are wanted: planned on placeholder sizes (the operands' may not
    # match yet).
    ndims = (len(lhs_padded.shape), len(rhs_padded.shape))
    plan = einsum_lib._plan(einsum_str, (2,) * ndims[0], (2,) * ndims[1])
    (lhs_c, rhs_c), _ = plan.dimension_numbers
    rhs_padded = _match(rhs_padded, list(rhs_c), [lhs_padded.shape[a] for a in lhs_c])
    lhs_padded = _match(lhs_padded, list(lhs_c), [rhs_padded.shape[a] for a in rhs_c])
    return einsum_lib.einsum(
        einsum_str, lhs_padded, rhs_padded, preferred_element_type=preferred_element_type, **kwargs
    )


def quantize_act(
    array: jax.Array, how: HowToQuantize, rule: Any, act_name: str | None
) -> qarray.QArray:
    """ptq's quantize_act (a static scale on the running module, if any) with padding."""
    return ptq_lib.quantize_act(array, how, rule, act_name, quantize=quantize)


def create_quantized_param(
    name: str, value: jax.Array, how: HowToQuantize
) -> ptq_lib.WithAux[qarray.QArray]:
    """A quantized weight (padded) as PTQ stores it; ``name`` is the param's, for messages."""
    del name  # outside a module there is nothing to store it in
    return ptq_lib.WithAux(quantize(value, how), how)


def quantize_params(
    params: Any,
    abstract_quantized_params: Any,
    quant_stats: Any = flax.core.FrozenDict(),  # noqa: B008 - immutable, as in ptq
) -> Any:
    """ptq.quantize_params for a PaddedPtqProvider model: weights padded to whole tiles."""
    return ptq_lib.quantize_params(
        params, abstract_quantized_params, quant_stats, quantize=quantize
    )


class PaddedPtqProvider(ptq_lib.PtqProvider):
    """PtqProvider whose weights and activations are padded to whole tiles before quantizing,
    and whose dot_general / einsum take the padded operands."""

    def quantized_dot_general(self, rule, op_id, module, lhs, rhs, dimension_numbers):
        how = op_adapter.dot_general_how(rule, lhs, rhs, dimension_numbers)
        lhs, rhs = self._prepare_operands(lhs, rhs, how, rule, op_id, module)
        return dot_general(lhs, rhs, dimension_numbers)

    def quantized_einsum(self, rule, op_id, module, einsum_str, lhs, rhs):
        how = op_adapter.einsum_how(rule, lhs, rhs, einsum_str)
        lhs, rhs = self._prepare_operands(lhs, rhs, how, rule, op_id, module)
        return einsum(einsum_str, lhs, rhs)

    def quantize_weight(self, module, ref, value, how):
        return ptq_lib.create_quantized_param(module, ref, value, how, quantize=quantize)

    def quantize_act(self, module, array, how, rule, act_name):
        return ptq_lib.quantize_act(array, how, rule, act_name, module=module, quantize=quantize)


__all__ = ["PaddedPtqProvider", "PaddedQArray"]
