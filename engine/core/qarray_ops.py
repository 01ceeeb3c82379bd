"""Shape manipulation of QArrays: reshape, transpose, swapaxes, indexing.

Each operation moves the codes as numpy would and moves the scale (and zero point) so that
dequantize commutes with it: dequantize(op(qa)) == op(dequantize(qa)). Where the scale layout can't
follow (a reshape or slice that cuts through a tile) a ValueError says so; dequantize first then.

Lingo: per axis, `count` = scale entries along it, `tile` = elements sharing one entry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from qmill.engine.core import tiling

# A QArray: typed by a variable rather than imported, because qarray.py imports this module for
# its methods (every function here maps one QArray to another with its .replace).
QArray = TypeVar("QArray")

# Factor kinds of the mixed-radix decomposition used by reshape.
_COUNT, _TILE = "count", "tile"


def _map_params(qa: QArray, fn: Any) -> dict[str, Any]:
    return {
        "scale": fn(qa.scale),
        "zero_point": None if qa.zero_point is None else fn(qa.zero_point),
    }


def _resolve_shape(shape: Sequence[int], size: int) -> tuple[int, ...]:
    shape = [int(s) for s in shape]
    if shape.count(-1) > 1:
        raise ValueError(f"can only infer one dimension in reshape {tuple(shape)}")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = size // known if known else 0
    if math.prod(shape) != size:
        raise ValueError(f"cannot reshape array of size {size} into shape {tuple(shape)}")
    return tuple(shape)


def _new_tiles(old_shape: tuple[int, ...], tiles: tuple[int, ...], new_shape: tuple[int, ...]):
    """Tiles for new_shape that keep every element's scale, or None if impossible.

    Flattened row-major, each old axis is (count, tile): a run of scale-varying factors then a
    run of shared ones. A new axis is representable iff, after re-cutting these factors at its
    boundaries, all its count factors come before all its tile factors.
    """
    factors = []
    for size, tile in zip(old_shape, tiles, strict=True):
        factors += [[size // tile, _COUNT], [tile, _TILE]]
    factors = [f for f in factors if f[0] != 1]
    new_tiles = []
    for size in new_shape:
        kinds, tile = [], 1
        remaining = size
        while remaining > 1:
            if not factors:
                return None
            f = factors[0]
            if f[0] <= remaining and remaining % f[0] == 0:
                factors.pop(0)
                take = f[0]
            elif f[0] % remaining == 0:
                f[0] //= remaining  # cut the factor at this axis' boundary
                take = remaining
            else:
                return None
            kinds.append(f[1])
            if f[1] == _TILE:
                tile *= take
            remaining //= take
        if _TILE in kinds and _COUNT in kinds[kinds.index(_TILE) :]:
            return None
        new_tiles.append(tile)
    return tuple(new_tiles)


def reshape(qa: QArray, *shape: Any) -> QArray:
    """Reshapes codes and scales together, keeping each element's scale.

    Raises:
      ValueError: a reshape that would split or merge tiles inconsistently.
    """
    if len(shape) == 1 and not isinstance(shape[0], int | np.integer):
        shape = tuple(shape[0])
    new_shape = _resolve_shape(shape, qa.qvalue.size)
    old_shape = tuple(qa.qvalue.shape)
    new_tiles = _new_tiles(old_shape, qa.scale_tile_shape, new_shape)
    if new_tiles is None:
        raise ValueError(
            f"cannot reshape a QArray of shape {old_shape} with scale shape "
            f"{tuple(qa.scale.shape)} into {new_shape}: the reshape would cut through scale "
            "tiles; dequantize first or choose a reshape that keeps tiles whole"
        )
    new_scale_shape = tiling.scale_shape(new_shape, new_tiles)
    return qa.replace(
        qvalue=qa.qvalue.reshape(new_shape), **_map_params(qa, lambda p: p.reshape(new_scale_shape))
    )


def transpose(qa: QArray, *axes: Any) -> QArray:
    if len(axes) == 1 and axes[0] is not None and not isinstance(axes[0], int | np.integer):
        axes = tuple(axes[0])
    if not axes or axes == (None,):
        axes = tuple(reversed(range(qa.ndim)))
    return qa.replace(
        qvalue=qa.qvalue.transpose(axes), **_map_params(qa, lambda p: p.transpose(axes))
    )


def swapaxes(qa: QArray, axis1: int, axis2: int) -> QArray:
    axes = list(range(qa.ndim))
    axes[axis1], axes[axis2] = axes[axis2], axes[axis1]
    return transpose(qa, tuple(axes))


def _normalize_key(key: Any, ndim: int) -> list[Any]:
    key = list(key) if isinstance(key, tuple) else [key]
    n_ellipsis = sum(k is Ellipsis for k in key)
    if n_ellipsis > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    used = sum(k is not None and k is not Ellipsis for k in key)
    if used > ndim:
        raise IndexError(f"too many indices for a QArray of rank {ndim}")
    if n_ellipsis:
        i = key.index(Ellipsis)
        key[i : i + 1] = [slice(None)] * (ndim - used)
    else:
        key += [slice(None)] * (ndim - used)
    return key


def _scale_index(k: Any, size: int, tile: int, axis: int) -> Any:
    """The index into the scale for index `k` on an axis of `size` with `tile`."""
    count = size // tile
    if isinstance(k, int | np.integer):
        if not -size <= k < size:
            raise IndexError(f"index {k} is out of bounds for axis {axis} with size {size}")
        return 0 if count == 1 else (int(k) % size) // tile
    if isinstance(k, slice):
        if count == 1:
            return slice(None)
        if tile == 1:
            return k
        start, stop, step = k.indices(size)
        if step == 1 and start % tile == 0 and (stop % tile == 0 or stop == size):
            return slice(start // tile, max(start, stop) // tile)
        raise ValueError(
            f"slice {k} on axis {axis} cuts through scale tiles of {tile}; slice on multiples of "
            f"{tile} with step 1, or dequantize first"
        )
    arr = np.asarray(k)
    if arr.dtype.kind in "iu":
        if count == 1:
            return np.zeros_like(arr)
        if tile == 1:
            return arr
        return (arr % size) // tile
    raise TypeError(f"unsupported index {k!r} on axis {axis} (only ints, slices, int arrays)")


def getitem(qa: QArray, key: Any) -> QArray:
    """Indexes codes and scales together (ints, slices, None, ..., one integer-array index)."""
    key = _normalize_key(key, qa.ndim)
    tiles = qa.scale_tile_shape
    scale_key, axis = [], 0
    for k in key:
        if k is None:
            scale_key.append(None)
            continue
        scale_key.append(_scale_index(k, qa.qvalue.shape[axis], tiles[axis], axis))
        axis += 1
    if sum(not isinstance(k, int | slice | np.integer) and k is not None for k in key) > 1:
        raise ValueError("a QArray supports at most one integer-array index")
    qkey, skey = tuple(key), tuple(scale_key)
    return qa.replace(qvalue=qa.qvalue[qkey], **_map_params(qa, lambda p: p[skey]))
