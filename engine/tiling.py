"""Tiles: which elements share a scale, and how to reduce or broadcast over them.

Lingo:
  tile        per axis, how many consecutive elements share one scale. A channelwise axis has
              tile 1, a fully reduced axis has tile == size, a tiled (sub-channel) axis has
              1 < tile < size.
  scale shape per axis size // tile; same rank as the array.
  split form  the array reshaped so each partly tiled axis i becomes (size_i // tile_i, tile_i);
              reductions and broadcasts over tiles are then plain axis operations, and the reshape
              is free (no copy) for XLA.

Everything here is shape arithmetic on Python ints, so it runs at trace time.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import jax
import jax.numpy as jnp


def _normalize_axis(axis: int, ndim: int, what: str) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"{what} axis {axis} is out of range for an array of rank {ndim}")
    return axis % ndim


def resolve_tiles(
    shape: Sequence[int],
    channelwise_axes: Collection[int] = (),
    tiled_axes: Mapping[int, int | float] | None = None,
) -> tuple[int, ...]:
    """Tile size per axis for an array of `shape`.

    Args:
      shape: the array's shape.
      channelwise_axes: axes with one scale per index (tile 1).
      tiled_axes: {axis: tile}; an int tile is a size, a float f means round(size * f).

    Returns:
      One tile per axis; axes named nowhere are reduced whole (tile == size).

    Raises:
      ValueError: an axis out of range or both channelwise and tiled, a non-positive tile, or a
        tile that does not divide its axis.
    """
    ndim = len(shape)
    tiles = list(shape)
    channelwise = {_normalize_axis(a, ndim, "channelwise") for a in channelwise_axes}
    for axis in channelwise:
        tiles[axis] = 1
    for axis, tile in (tiled_axes or {}).items():
        axis = _normalize_axis(axis, ndim, "tiled")
        if axis in channelwise:
            raise ValueError(f"axis {axis} can't be both channelwise and tiled")
        size = shape[axis]
        if isinstance(tile, float):
            tile = round(size * tile)
        if tile <= 0:
            raise ValueError(f"tile {tile} on axis {axis} must be positive")
        if size % tile:
            raise ValueError(
                f"tile {tile} does not divide axis {axis} of size {size} (shape {tuple(shape)}); "
                "choose a tile that divides the axis"
            )
        tiles[axis] = tile
    return tuple(tiles)


def scale_shape(shape: Sequence[int], tiles: Sequence[int]) -> tuple[int, ...]:
    """Shape of the scale for an array of `shape` with `tiles`."""
    return tuple(s // t if t else 1 for s, t in zip(shape, tiles, strict=True))


def tiles_of(shape: Sequence[int], scale_shape_: Sequence[int]) -> tuple[int, ...]:
    """Tiles implied by an array shape and its scale shape (the inverse of `scale_shape`).

    Raises:
      ValueError: ranks differ or a scale axis does not divide its array axis.
    """
    if len(shape) != len(scale_shape_):
        raise ValueError(
            f"scale rank {len(scale_shape_)} must equal the array rank {len(shape)} "
            f"(array {tuple(shape)}, scale {tuple(scale_shape_)})"
        )
    tiles = []
    for size, n in zip(shape, scale_shape_, strict=True):
        if n == 0 or size % n:
            raise ValueError(
                f"scale shape {tuple(scale_shape_)} does not divide array shape {tuple(shape)}"
            )
        tiles.append(size // n)
    return tuple(tiles)


def _split_shape(shape: Sequence[int], tiles: Sequence[int]) -> tuple[list[int], list[int]]:
    """Split-form shape, and per original axis the index of its tile sub-axis (-1 if unsplit)."""
    split, sub = [], []
    for size, tile in zip(shape, tiles, strict=True):
        if 1 < tile < size:
            split += [size // tile, tile]
            sub.append(len(split) - 1)
        else:
            split.append(size)
            sub.append(-1)
    return split, sub


def reduce_tiles(
    x: jax.Array, tiles: Sequence[int], reducer: Callable[..., jax.Array]
) -> jax.Array:
    """Applies `reducer(x, axis=..., keepdims=True)` inside every tile; result has scale shape."""
    split, sub = _split_shape(x.shape, tiles)
    xs = x.reshape(split)
    axes = []
    pos = 0
    for size, tile, s in zip(x.shape, tiles, sub, strict=True):
        if s >= 0:
            axes.append(s)
            pos += 2
            continue
        if tile == size and tile != 1:
            axes.append(pos)
        pos += 1
    out = reducer(xs, axis=tuple(axes), keepdims=True) if axes else xs
    return out.reshape(scale_shape(x.shape, tiles))


def apply_tiled(
    fn: Callable[..., jax.Array], x: jax.Array, *per_tile: jax.Array | None
) -> jax.Array:
    """Computes `fn(x, *per_tile)` elementwise, each per-tile array broadcast over its tiles.

    Every per-tile array has the same rank as `x` and a shape dividing it (the "generic broadcast"
    of QArray); None entries are passed through. Tiled axes are split rather than repeated, so
    nothing the size of `x` is materialized besides the result.
    """
    ref = next(p for p in per_tile if p is not None)
    tiles = tiles_of(x.shape, ref.shape)
    split, sub = _split_shape(x.shape, tiles)
    xs = x.reshape(split)
    expanded = []
    for p in per_tile:
        if p is None:
            expanded.append(None)
            continue
        if p.shape != ref.shape:
            raise ValueError(f"per-tile arrays disagree: {p.shape} vs {ref.shape}")
        shape = []
        for n, s in zip(p.shape, sub, strict=True):
            shape += [n, 1] if s >= 0 else [n]
        expanded.append(p.reshape(shape))
    return fn(xs, *expanded).reshape(x.shape)


def broadcast_to(per_tile: jax.Array, shape: Sequence[int]) -> jax.Array:
    """Materializes a per-tile array at full `shape` by repeating each entry over its tile."""
    tiles = tiles_of(shape, per_tile.shape)
    out = per_tile
    for axis, tile in enumerate(tiles):
        if tile > 1:
            out = jnp.repeat(out, tile, axis=axis, total_repeat_length=shape[axis])
    return out
