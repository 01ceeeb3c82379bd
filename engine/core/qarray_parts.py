"""QArray's arithmetic on plain arrays: HowToQuantize, and quantizing to codes, scale and zero
point and back (`quantize_bytes`, `dequantize_bytes`) without building a QArray.

qarray.py re-exports every public name here and adds the QArray pytree (a flax.struct
dataclass) on top; the model-free path (engine/modelfree) needs only this module, so quantizing
a checkpoint does not import flax (~0.1 s of `qmill quantize`'s start-up).

Lingo: as qarray.py's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.core import calibration as calibration_lib
from qmill.engine.core import numerics, qarray_util, qcodes, qtypes, tiling

# A noise function for stochastic rounding: shape -> noise added to x / scale before rounding
# (uniform in [-0.5, 0.5) gives unbiased rounding).
NoiseFn = Callable[[tuple[int, ...]], jax.Array]


def dtype_name(dtype: Any) -> str | None:
    return None if dtype is None else jnp.dtype(dtype).name


@dataclasses.dataclass(frozen=True, kw_only=True)
class HowToQuantize:
    """How one tensor is quantized. Frozen and hashable: usable as a static jit argument."""

    # Logical qtype; any accepted form is normalized to its canonical name.
    qtype: str
    # Axes with one scale per index.
    channelwise_axes: tuple[int, ...] = ()
    # Sorted ((axis, tile), ...); a dict is accepted. Int tile = size, float f = round(size * f).
    tiled_axes: tuple[tuple[int, int | float], ...] = ()
    # "<method>[,<args>]" (calibration.py).
    calibration_method: str = "absmax"
    # Stochastic rounding: shape -> noise added before rounding; None = round to nearest even.
    noise_fn: NoiseFn | None = None
    # dtype name of the scale; None = the input's dtype.
    scale_dtype: str | None = None
    # Whose arithmetic (numerics.ARITHMETICS): "" the reference's, "torch" PyTorch's.
    arithmetic: str = ""
    # nvfp4 with a global scale (numerics.nv_global_scales); None: E4M3 block scales alone.
    global_scale: float | None = None

    def __post_init__(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        set_("qtype", qtypes.name(self.qtype))
        set_("channelwise_axes", qarray_util.Axes(int(a) for a in self.channelwise_axes))
        tiled = self.tiled_axes
        items = tiled.items() if isinstance(tiled, Mapping) else (tiled or ())
        set_("tiled_axes", qarray_util.AxisTiles(sorted((int(a), t) for a, t in items)))
        calibration_lib.parse(self.calibration_method)  # fail early on a bad method
        if self.arithmetic not in numerics.ARITHMETICS:
            raise ValueError(f"arithmetic {self.arithmetic!r} is not one of {numerics.ARITHMETICS}")
        set_("scale_dtype", dtype_name(self.scale_dtype))
        if self.global_scale is not None and self.qtype != "nvfp4":
            raise ValueError(f"global_scale applies to nvfp4 only, not {self.qtype}")
        self._check_required_tile()

    def _check_required_tile(self) -> None:
        """mx / nv formats: refused at construction, as the reference does, unless their tile is
        given on some axis (a float tile depends on the shape: checked again in `tiles`)."""
        required = qtypes.get(self.qtype).required_tile
        if required is None:
            return
        if not self.tiled_axes:
            raise ValueError(
                f"Format {self.qtype} requires `tiled_axes` to be specified: a tile of "
                f"{required} elements along the axis whose blocks share a scale"
            )
        for axis, tile in self.tiled_axes:
            if isinstance(tile, int) and tile != required:
                raise ValueError(
                    f"Format {self.qtype} requires a tile size of {required}, but axis {axis} "
                    f"got {tile}"
                )

    @property
    def tiled_axes_dict(self) -> dict[int, int | float]:
        return dict(self.tiled_axes)

    def tiles(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Tile per axis for an array of `shape`; fixed calibration means one per-tensor tile."""
        if calibration_lib.parse(self.calibration_method).is_fixed:
            return tuple(shape)
        tiles = tiling.resolve_tiles(shape, self.channelwise_axes, self.tiled_axes_dict)
        required = qtypes.get(self.qtype).required_tile
        if required is not None:
            for axis, tile in self.tiled_axes:
                if tiles[axis] != required:
                    raise ValueError(
                        f"Format {self.qtype} requires a tile size of {required}, but axis "
                        f"{axis} got {tiles[axis]} (tiled_axes={{{axis}: {tile}}})"
                    )
        return tiles


def check_input(array: Any) -> jax.Array:
    array = jnp.asarray(array)
    if not numerics.should_quantize(array.dtype):
        raise TypeError(
            f"only float arrays (bfloat16, float16, float32, float64) can be quantized, got "
            f"{np.dtype(array.dtype).name}"
        )
    return array


def calibrate(array: jax.Array, how: HowToQuantize) -> dict[str, jax.Array]:
    """The calibration dict of `array` per tile of `how`."""
    array = check_input(array)
    return calibration_lib.calibrate(array, how.calibration_method, how.tiles(array.shape))


def compute_scale_zero_point(
    calibration: Mapping[str, jax.Array], qtype: Any, scale_dtype: Any = None
) -> tuple[jax.Array, jax.Array | None]:
    """(scale, zero_point or None) from a calibration dict (numerics.compute_scale_zero_point)."""
    return numerics.compute_scale_zero_point(calibration, qtype, scale_dtype)


def encode(
    array: jax.Array,
    qt: qtypes.QType,
    scale: jax.Array,
    zero_point: jax.Array | None,
    noise_fn: NoiseFn | None,
    as_bytes: bool,
    torch: bool = False,
    reciprocal: bool = False,
) -> jax.Array:
    """convert(x / scale (+ zp) (+ noise)); `as_bytes` as in qcodes.to_qtype; `torch`: every
    division a true one, as PyTorch divides by a broadcast scale; `reciprocal`: x times the
    scale's reciprocal (numerics.RECIPROCAL)."""

    def shift(x: jax.Array, s: jax.Array, zp: jax.Array | None = None) -> jax.Array:
        # In the input dtype with the scale (and zero point) cast to it; see numerics on exactness.
        s = numerics.fit(s, x.dtype)
        if torch:
            # A subnormal MX scale (2^-127) is flushed to 0 on XLA:CPU: x / 1 gives its codes.
            s = jnp.where(s == 0, jnp.ones_like(s), s)
        # bfloat16 quotients round the same either way (numerics.TORCH): the faster multiply.
        exact = torch and np.dtype(x.dtype) != np.dtype(jnp.bfloat16)
        if reciprocal:
            # The reciprocal rounded to x's dtype (jnp.reciprocal on bf16 rounds it, where XLA's
            # own rewrite of a broadcast division keeps it in float32), then the product.
            r = numerics.reciprocal(s, x.dtype)
            r = numerics.opaque(r, x) if isinstance(r, float) else numerics.fit(r, x.dtype)
            y = numerics.fit(numerics.widen(x) * r, x.dtype)
        elif s.shape == x.shape or exact:
            y = numerics.divide_exact(x, s, x.dtype)
        else:
            y = numerics.divide_broadcast(x, s, x.dtype)
        if zp is None:
            return y
        return numerics.fit(numerics.settle(y) + numerics.from_qtype(zp, qt, x.dtype), x.dtype)

    y = tiling.apply_tiled(shift, array, numerics.widen(scale), zero_point)
    # Stochastic rounding applies to integer qtypes; the reference ignores noise for the others.
    if noise_fn is not None and qt.kind == qtypes.INT:
        noise = noise_fn(y.shape)
        dtype = jnp.result_type(array.dtype, noise.dtype)
        y = numerics.fit(numerics.settle(y) + numerics.widen(noise), dtype)
    return qcodes.to_qtype(y, qt, as_bytes=as_bytes)


def quantize_parts(
    array: jax.Array,
    how: HowToQuantize,
    scale_dtype: str | None,
    as_bytes: bool,
    global_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    calib = calibration_lib.calibrate(array, how.calibration_method, how.tiles(array.shape))
    if how.global_scale is not None:
        g = how.global_scale if global_scale is None else global_scale
        return _nv_global_parts(array, calib, how, g)
    torch = how.arithmetic == numerics.TORCH
    scale, zero_point = numerics.compute_scale_zero_point(calib, how.qtype, torch=torch)
    qt = qtypes.get(how.qtype)
    reciprocal = how.arithmetic == numerics.RECIPROCAL
    codes = encode(
        array, qt, scale, zero_point, how.noise_fn, as_bytes, torch=torch, reciprocal=reciprocal
    )
    # The codes use the scale in the input's dtype; only the stored scale takes scale_dtype.
    scale_dtype = scale_dtype or how.scale_dtype
    return codes, scale if scale_dtype is None else scale.astype(scale_dtype), zero_point


def _nv_global_parts(
    array: jax.Array, calib: Mapping[str, jax.Array], how: HowToQuantize, g: float | jax.Array
) -> tuple[jax.Array, jax.Array, None]:
    """nvfp4 with a global scale: the stored scale is E4M3 (whatever scale_dtype says, as
    compressed-tensors stores it); the codes divide by it over the global scale, in float32."""
    if "absmax" not in calib:
        raise ValueError("nvfp4 with a global scale takes absmax calibration")
    qt = qtypes.get(how.qtype)
    scale, divisor = numerics.nv_global_scales(
        calib["absmax"], float(qt.bound), g, calib["absmax"].dtype
    )

    def shift(x: jax.Array, d: jax.Array) -> jax.Array:
        return numerics.divide_exact(x, d, jnp.float32)

    y = tiling.apply_tiled(shift, array, divisor)
    return qcodes.to_qtype(y, qt), scale, None


def quantize_bytes(
    array: jax.Array,
    how: HowToQuantize,
    *,
    scale_dtype: Any = None,
    global_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """qarray.quantize's (qvalue, scale, zero_point), with 4-bit integer qvalues as uint8 bytes.

    For callers that take the codes to the host (leaf.py): `storage_view` turns the bytes into
    the qtype's storage dtype there for free, where XLA:CPU would pack 4-bit values slowly
    (qcodes.to_qtype). Same bits as `quantize` otherwise. No NaN/Inf check: callers check.

    Raises:
      TypeError, ValueError: as `quantize`.
    """
    array = check_input(array)
    return quantize_parts(array, how, dtype_name(scale_dtype), True, global_scale)


def storage_view(codes: np.ndarray, qtype: Any) -> np.ndarray:
    """Host codes from `quantize_bytes` as an array of the qtype's storage dtype (no copy)."""
    storage = qtypes.get(qtype).storage
    return codes if codes.dtype == storage else codes.view(storage)


@jax.jit
def all_finite(x: jax.Array) -> jax.Array:
    """Whether x has no NaN/Inf: x · 0 is 0, or NaN where x is not finite, and a sum keeps it.

    Not read off the scales: XLA:CPU's float max may drop a NaN (see qarray.py's module doc).
    Its own jit: fused with the quantization, on bf16 it shares the f32 convert of x with the
    quantizing loop, which XLA then materializes as a whole f32 copy (6x slower); alone it adds
    one read of x (~1.6 ms for 4096² bf16 on the CPU). XLA doesn't fold x · 0 for floats.
    """
    return jnp.isfinite(jnp.sum(x * 0))


def dequantize_bytes(
    codes: jax.Array, qtype: Any, scale: jax.Array, zero_point: jax.Array | None
) -> jax.Array:
    """`dequantize` of parts, the qvalue as a QArray holds it or as `quantize_bytes` returns it."""
    qt = qtypes.get(qtype)
    dtype = scale.dtype

    def scale_back(q: jax.Array, s: jax.Array, zp: jax.Array | None = None) -> jax.Array:
        v = numerics.from_qtype(qcodes.from_bytes(q, qt), qt, dtype)
        if zp is not None:
            v = numerics.fit(v - numerics.from_qtype(zp, qt, dtype), dtype)
        return numerics.fit(v * s, dtype)

    out = tiling.apply_tiled(scale_back, codes, numerics.widen(scale), zero_point)
    return out.astype(dtype)
