"""QArray, HowToQuantize, and quantize / dequantize.

HowToQuantize and the arithmetic on plain arrays (quantize_bytes, dequantize_bytes, all_finite,
...) live in qarray_parts.py, which imports no flax; they are re-exported here.

Lingo:
  QArray        qvalue (codes, x's shape), scale and zero_point (same rank, each axis dividing x's),
                qtype (logical type of the codes). x ≈ (levels(qvalue) − zero_point) · scale, the
                scale "generically broadcast": each scale entry covers one tile of x.
  HowToQuantize the static recipe for one tensor: qtype, channelwise / tiled axes, calibration.
  calibration   {"absmax"} or {"min", "max"} per tile (calibration.py).

Invalid / non-finite input: `quantize` called eagerly (not under a jax transformation) raises
ValueError when x has a NaN/Inf. Under jit nothing can be raised: a tile holding NaN/Inf usually
gets a NaN/Inf scale and dequantizes to NaN, but XLA:CPU's max/min reductions drop NaN for some
shapes (e.g. float32 rows of 64+; openxla/xla#21461, the reference is affected alike), and then
the tile keeps a finite scale and the NaN becomes code 0. Callers that jit must check inputs
themselves (leaf.py does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.core import numerics, qarray_ops, qarray_parts, qcodes, qtypes, tiling
from qmill.engine.core.qarray_parts import HowToQuantize as HowToQuantize
from qmill.engine.core.qarray_parts import NoiseFn as NoiseFn
from qmill.engine.core.qarray_parts import all_finite as all_finite
from qmill.engine.core.qarray_parts import calibrate as calibrate
from qmill.engine.core.qarray_parts import compute_scale_zero_point as compute_scale_zero_point
from qmill.engine.core.qarray_parts import dequantize_bytes as dequantize_bytes
from qmill.engine.core.qarray_parts import quantize_bytes as quantize_bytes
from qmill.engine.core.qarray_parts import storage_view as storage_view
from qmill.engine.core.qarray_util import broadcast_to as broadcast_to
from qmill.engine.core.qarray_util import call_with_generic_broadcast as call_with_generic_broadcast
from qmill.engine.core.qarray_util import (
    clip_gradient_to_calibration as clip_gradient_to_calibration,
)
from qmill.engine.core.qarray_util import clip_to_calibration as clip_to_calibration
from qmill.engine.core.qarray_util import (
    get_accumulator_and_result_type as get_accumulator_and_result_type,
)
from qmill.engine.core.qarray_util import get_scale_shape as get_scale_shape
from qmill.engine.core.qarray_util import get_tiled_axes as get_tiled_axes
from qmill.engine.core.qarray_util import is_gradient_clipping_noop as is_gradient_clipping_noop
from qmill.engine.core.sparsity import HowToSparsify as HowToSparsify
from qmill.engine.core.sparsity import sparsify as sparsify


@flax.struct.dataclass
class QArray:
    """A quantized array; see the module docstring. A pytree whose qtype is static."""

    qvalue: jax.Array
    scale: jax.Array
    zero_point: jax.Array | None = None
    qtype: str | None = flax.struct.field(pytree_node=False, default=None)

    def __post_init__(self) -> None:
        if self.qtype is None and hasattr(self.qvalue, "dtype"):
            object.__setattr__(self, "qtype", qtypes.name(self.qvalue.dtype))
        elif self.qtype is not None:
            object.__setattr__(self, "qtype", qtypes.name(self.qtype))
        validate(self)

    shape = property(lambda self: tuple(self.qvalue.shape))
    ndim = property(lambda self: self.qvalue.ndim)
    size = property(lambda self: self.qvalue.size)
    # The dequantized dtype is the scale's.
    dtype = property(lambda self: self.scale.dtype)
    T = property(lambda self: qarray_ops.transpose(self))
    mT = property(lambda self: qarray_ops.swapaxes(self, -1, -2))

    @property
    def scale_tile_shape(self) -> tuple[int, ...]:
        return tiling.tiles_of(self.qvalue.shape, self.scale.shape)

    @property
    def zero_point_tile_shape(self) -> tuple[int, ...] | None:
        if self.zero_point is None:
            return None
        return tiling.tiles_of(self.qvalue.shape, self.zero_point.shape)

    def astype(self, dtype: Any) -> QArray:
        """Casts the dequantized dtype (the scale's); the codes are unchanged."""
        return self.replace(scale=self.scale.astype(dtype))

    def reshape(self, *shape: Any) -> QArray:
        return qarray_ops.reshape(self, *shape)

    def transpose(self, *axes: Any) -> QArray:
        return qarray_ops.transpose(self, *axes)

    def swapaxes(self, axis1: int, axis2: int) -> QArray:
        return qarray_ops.swapaxes(self, axis1, axis2)

    def __getitem__(self, key: Any) -> QArray:
        return qarray_ops.getitem(self, key)


def validate(qa: QArray) -> None:  # the reference's validate_qarray
    """Checks shapes and dtypes when the leaves are arrays (leaves may be anything in pytree maps).

    Raises:
      ValueError: scale / zero point rank or shape not dividing qvalue's, or a qvalue dtype that
        is not the qtype's storage dtype.
    """
    leaves = (qa.qvalue, qa.scale) + (() if qa.zero_point is None else (qa.zero_point,))
    if not all(hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves):
        return
    tiling.tiles_of(qa.qvalue.shape, qa.scale.shape)
    if qa.zero_point is not None and qa.zero_point.shape != qa.scale.shape:
        raise ValueError(
            f"zero_point shape {qa.zero_point.shape} must equal scale shape {qa.scale.shape}"
        )
    if qa.qtype is not None:
        qt = qtypes.get(qa.qtype)
        storage, held = qt.storage, np.dtype(qa.qvalue.dtype)
        # Float formats (fp8, mx, nv) may hold their values in a wider float dtype, as the
        # reference's QArray allows (e.g. float32 values on the mxfp8 grid); they dequantize alike.
        wider_float = qt.kind == qtypes.FLOAT and jnp.issubdtype(held, jnp.floating)
        if held != storage and not wider_float:
            raise ValueError(
                f"qvalue dtype {np.dtype(qa.qvalue.dtype).name} is not the storage dtype "
                f"{storage.name} of qtype {qa.qtype}"
            )
    if not jnp.issubdtype(qa.scale.dtype, jnp.floating):
        raise ValueError(f"scale must be floating point, got {np.dtype(qa.scale.dtype).name}")


# The reference's flag (read at each call): multiply by the scale's reciprocal instead of dividing
# by the scale when quantizing (AQT's arithmetic; faster under some fusions, the codes may differ
# by one where the reciprocal rounds). Only qarray's quantize and quantize_with_scale_zero_point
# (and so the providers and ops) read it; the model-free path keeps the division.
USE_RECIPROCAL_FOR_QUANTIZATION = False


def quantize_with_scale_zero_point(
    array: jax.Array,
    qtype: Any,
    scale: jax.Array,
    zero_point: jax.Array | None,
    noise_fn: NoiseFn | None = None,
) -> QArray:
    """Quantizes with a given scale (and zero point): q = convert(x / scale (+ zp) (+ noise))."""
    array = qarray_parts.check_input(array)
    qt = qtypes.get(qtype)
    reciprocal = USE_RECIPROCAL_FOR_QUANTIZATION
    codes = qarray_parts.encode(
        array, qt, scale, zero_point, noise_fn, as_bytes=False, reciprocal=reciprocal
    )
    return QArray(codes, scale, zero_point, qt.name)


def _quantize(array: jax.Array, how: HowToQuantize, scale_dtype: str | None) -> QArray:
    codes, scale, zero_point = qarray_parts.quantize_parts(array, how, scale_dtype, as_bytes=False)
    return QArray(codes, scale, zero_point, how.qtype)


_quantize_eager = jax.jit(qarray_parts.quantize_parts, static_argnums=(1, 2, 3))


def _packs_on_host(array: jax.Array, qtype: str) -> bool:
    """Whether 4-bit codes are better packed by numpy than by XLA: on the CPU, ~5x faster.

    XLA:CPU writes int4/uint4 arrays one element at a time (qcodes.to_qtype); computing the
    codes as bytes, viewing them as the storage dtype on the host and putting them back costs a
    host round trip, which on the CPU is a memcpy. Accelerators pack fine and keep the codes.
    """
    if qcodes.byte_dtype(qtype) == np.dtype(qtypes.get(qtype).storage):  # not 4-bit
        return False
    return all(d.platform == "cpu" for d in array.devices())


def _quantize_by_parts(array: jax.Array, how: HowToQuantize) -> QArray:
    """The reference's quantize, step by step through this module's functions: a caller who
    replaced this module's compute_scale_zero_point (the reference's own tests monkeypatch it)
    gets it used, as the reference's quantize would."""
    scale, zero_point = compute_scale_zero_point(calibrate(array, how), how.qtype)
    return quantize_with_scale_zero_point(array, how.qtype, scale, zero_point, how.noise_fn)


def quantize(array: jax.Array, how: HowToQuantize, *, scale_dtype: Any = None) -> QArray:
    """Quantizes `array` as `how` says (dynamic range). Jittable with `how` static.

    Raises:
      TypeError: a non-float input.
      ValueError: a bad tiling or method, an asymmetric method for a symmetric-only qtype, or
        (eagerly only) NaN/Inf in the input.
    """
    array = qarray_parts.check_input(array)
    scale_dtype = qarray_parts.dtype_name(scale_dtype)
    if compute_scale_zero_point is not qarray_parts.compute_scale_zero_point:
        return _quantize_by_parts(array, how)
    if USE_RECIPROCAL_FOR_QUANTIZATION and not how.arithmetic:
        how = dataclasses.replace(how, arithmetic=numerics.RECIPROCAL)
    if isinstance(array, jax.core.Tracer):
        return _quantize(array, how, scale_dtype)
    as_bytes = _packs_on_host(array, how.qtype)
    codes, scale, zero_point = _quantize_eager(array, how, scale_dtype, as_bytes)
    finite = all_finite(array)
    # Under an outer trace (a concrete array closed over in jit) the flag is traced: no check.
    if not isinstance(finite, jax.core.Tracer) and not bool(finite):
        raise ValueError(
            f"array of shape {array.shape} contains NaN or Inf; quantizing it would spread them "
            "over whole scale tiles. Clean the tensor or leave it unquantized"
        )
    if as_bytes:
        storage = qtypes.get(how.qtype).storage
        if isinstance(codes, jax.core.Tracer):  # under an outer trace: convert in the graph
            codes = qcodes.from_bytes(codes, how.qtype).astype(storage)
        else:
            # Where the input is; committed only if it was, as a jitted output would be.
            place = array.sharding if array.committed else None
            codes = jax.device_put(storage_view(np.asarray(codes), how.qtype), place)
    return QArray(codes, scale, zero_point, how.qtype)


def dequantize(qa: QArray) -> jax.Array:
    """x̂ = (levels(q) − zero_point) · scale, in the scale's dtype."""
    return dequantize_bytes(qa.qvalue, qa.qtype, qa.scale, qa.zero_point)


def quantize_api(
    array: jax.Array,
    qtype: Any,
    *,
    channelwise_axes: Collection[int] = (),
    tiled_axes: Mapping[int, int | float] | None = None,
    calibration_method: str = "absmax",
    scale_dtype: Any = None,
) -> QArray:
    """Quantizes without building a HowToQuantize (the seeds' public `quantize`)."""
    how = HowToQuantize(
        qtype=qtype,
        channelwise_axes=tuple(channelwise_axes),
        tiled_axes=dict(tiled_axes or {}),
        calibration_method=calibration_method,
    )
    return quantize(array, how, scale_dtype=scale_dtype)


# The reference's name for `validate`.
validate_qarray = validate
