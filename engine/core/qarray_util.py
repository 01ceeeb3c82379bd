"""The reference's smaller qarray helpers, re-exported by qarray: tiled axes, broadcasting, clips.

Kept apart from qarray.py (which imports this module) so that file stays about quantizing; these
take QArrays by duck type (anything with qvalue / scale / zero_point).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from qmill.engine.core import calibration as calibration_lib
from qmill.engine.core import tiling


def _is_qarray(x: Any) -> bool:
    return hasattr(x, "qvalue") and hasattr(x, "scale")


def get_tiled_axes(array: Any) -> dict[int, int]:
    """{axis: tile} of a QArray's sub-channel axes: neither per-channel nor one shared scale."""
    tiled = {}
    for axis, (size, n) in enumerate(zip(array.qvalue.shape, array.scale.shape, strict=True)):
        if n not in (1, size):
            tiled[axis] = size // n
    return tiled


def get_scale_shape(array_shape: Sequence[int], how: Any) -> tuple[int, ...]:
    """Shape of the scale `how` (a HowToQuantize) gives an array of `array_shape`."""
    return tiling.scale_shape(array_shape, how.tiles(tuple(array_shape)))


def call_with_generic_broadcast(
    op: Callable[[jax.Array, jax.Array], jax.Array], x: jax.Array, y: jax.Array
) -> jax.Array:
    """op(x, y) elementwise where, per axis, one size divides the other (the smaller one is
    repeated over tiles, QArray's "generic broadcast"); both of the same rank."""
    if x.ndim != y.ndim:
        raise ValueError(f"generic broadcast needs equal ranks, got {x.shape} and {y.shape}")
    shape = []
    for a, b in zip(x.shape, y.shape, strict=True):
        if max(a, b) % min(a, b):
            raise ValueError(f"cannot broadcast between {x.shape} and {y.shape}")
        shape.append(max(a, b))
    full = tuple(shape)
    xs = x if x.shape == full else tiling.broadcast_to(x, full)
    ys = y if y.shape == full else tiling.broadcast_to(y, full)
    return op(xs, ys)


def broadcast_to(operand: Any, target_shape: Sequence[int]) -> Any:
    """Broadcasts an array or a QArray to `target_shape`, generically: leading axes are added,
    and along each axis an entry is repeated over the target_size / size elements it covers (a
    size-1 axis broadcasts as numpy's does; a size-8 axis to 64 repeats each entry 8 times).
    For a QArray codes, scale and zero point all follow, so dequantize commutes with it.

    Raises:
      ValueError: an axis whose size does not divide the target's.
    """
    target = tuple(int(n) for n in target_shape)
    if tuple(operand.shape) == target:
        return operand

    def component(x: jax.Array | None) -> jax.Array | None:
        if x is None:
            return None
        x = jnp.asarray(x)
        if x.ndim > len(target):
            raise ValueError(f"cannot broadcast shape {x.shape} to the lower rank {target}")
        x = x.reshape((1,) * (len(target) - x.ndim) + tuple(x.shape))
        try:
            return tiling.broadcast_to(x, target)
        except ValueError as e:
            raise ValueError(f"cannot broadcast shape {x.shape} to {target}: {e}") from None

    if not _is_qarray(operand):
        return component(operand)
    return operand.replace(
        qvalue=component(operand.qvalue),
        scale=component(operand.scale),
        zero_point=component(operand.zero_point),
    )


def _bounds(calibration: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    if "min" in calibration and "max" in calibration:
        return calibration["min"], calibration["max"]
    if "absmax" in calibration:
        return -calibration["absmax"], calibration["absmax"]
    raise ValueError(
        f"a calibration needs 'min' and 'max' or 'absmax', got keys {sorted(calibration)}"
    )


def clip_to_calibration(
    array: jax.Array,
    calibration: Mapping[str, jax.Array],
    tiled_axes: Mapping[int, int | float] | None = None,
) -> jax.Array:
    """Clips every element to the range of its tile's calibration.

    The tiles follow from the calibration's shape; `tiled_axes` is accepted for the reference's
    signature and must agree with it.
    """
    del tiled_axes  # implied by the calibration's shape (tiling.tiles_of checks it divides)
    lo, hi = _bounds(calibration)
    clip = lambda x, lo_, hi_: jnp.clip(x, lo_.astype(x.dtype), hi_.astype(x.dtype))  # noqa: E731
    return tiling.apply_tiled(clip, array, lo, hi)


def is_gradient_clipping_noop(calibration_method: str) -> bool:
    """Whether a calibration covers all of the data it is computed from (absmax / minmax without
    a factor below 1), so clipping a gradient to it changes nothing."""
    method = calibration_lib.parse(calibration_method)
    return method.kind in ("absmax", "minmax") and (not method.args or method.args[0] >= 1.0)


def clip_gradient_to_calibration(
    g: jax.Array,
    array: jax.Array,
    calibration: Mapping[str, jax.Array],
    calibration_method: str,
) -> jax.Array:
    """The gradient `g` zeroed where `array` fell outside its calibrated range (straight-through
    estimator with clipping).

    absmax / minmax without a factor below 1 cover all the data they were computed from, so the
    gradient is returned as is (no mask materialized).
    """
    if is_gradient_clipping_noop(calibration_method):
        return g
    lo, hi = _bounds(calibration)
    inside = lambda x, lo_, hi_: (x >= lo_) & (x <= hi_)  # noqa: E731
    mask = tiling.apply_tiled(inside, array, lo, hi)
    return jnp.where(mask, g, jnp.zeros_like(g))


def get_accumulator_and_result_type(
    *args: Any, preferred_element_type: Any = None
) -> tuple[Any, Any]:
    """(accumulator dtype, result dtype) of a dot/conv of these arrays or QArrays.

    The result follows the dequantized dtypes (a QArray's is its scale's; 8 bits or fewer count
    as int32 / bfloat16, which promote) unless preferred_element_type is given; integer codes
    on every side accumulate in int32.
    """
    stored, dequantized = [], []
    for arg in args:
        stored.append(jnp.dtype(arg.qvalue.dtype if _is_qarray(arg) else arg.dtype))
        dequantized.append(jnp.dtype(arg.scale.dtype if _is_qarray(arg) else arg.dtype))
    result = preferred_element_type
    if result is None:
        widened = [
            (jnp.int32 if jnp.issubdtype(t, jnp.integer) else jnp.bfloat16)
            if t.itemsize <= 1
            else t
            for t in dequantized
        ]
        result = jnp.result_type(*widened)
    integer = all(jnp.issubdtype(t, jnp.integer) for t in stored)
    return (jnp.int32 if integer else result), result


class Axes(tuple):
    """HowToQuantize.channelwise_axes: a tuple of ints that also equals the same axes given as a
    list or set, as the reference's (any collection) compare in user code."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, list):
            return tuple.__eq__(self, tuple(other))
        if isinstance(other, set | frozenset):
            return set(self) == other
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = tuple.__hash__


class AxisTiles(tuple):
    """HowToQuantize.tiled_axes: sorted ((axis, tile), ...) (hashable, a static jit field) that
    also reads and compares as the reference's {axis: tile} mapping: ``tiles[1]``, ``.get``,
    ``.items()``, ``1 in tiles``, ``tiles == {1: 32}``. Iterating yields the pairs."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self._mapping() == dict(other)
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = tuple.__hash__

    def _mapping(self) -> dict[int, Any]:
        # Not dict(self): dict() would take the keys() method below for a mapping's.
        return dict(tuple(self))

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            return tuple.__getitem__(self, key)
        return self._mapping()[key]  # an axis, as in the reference's mapping

    def __contains__(self, key: object) -> bool:
        if isinstance(key, tuple):
            return tuple.__contains__(self, key)
        return key in self._mapping()

    def keys(self) -> Any:
        return self._mapping().keys()

    def values(self) -> Any:
        return self._mapping().values()

    def items(self) -> Any:
        return self._mapping().items()

    def get(self, axis: int, default: Any = None) -> Any:
        return self._mapping().get(axis, default)
