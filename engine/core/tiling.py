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


# A fully reduced axis at least twice this long is cut into chunks of this length first.
_CHUNK = 16


def _halve_max(x: jax.Array, axis: int) -> jax.Array:
    """max over `axis` (kept) as a tree of elementwise maxima of halves while the length is even.

    XLA:CPU reduces a non-minor axis (the tile axis of a split (n/128, 128, m) array) ~10x
    slower than a chain of `maximum(first half, second half)`, which fuses into one vectorized
    loop over the output. What is left (an odd length) goes to jnp.max.
    """
    while x.shape[axis] > 1 and x.shape[axis] % 2 == 0:
        half = x.shape[axis] // 2
        x = jnp.maximum(
            jax.lax.slice_in_dim(x, 0, half, axis=axis),
            jax.lax.slice_in_dim(x, half, 2 * half, axis=axis),
        )
    return jnp.max(x, axis=axis, keepdims=True) if x.shape[axis] > 1 else x


def _max_full_axis(x: jax.Array, axis: int) -> jax.Array:
    """max over a long non-minor `axis` (kept): chunks of _CHUNK halved, then jnp.max over them.

    Halving the whole axis would leave the last loops with few outputs to spread over threads;
    the chunk maxima are few enough for jnp.max to be fast.
    """
    size = x.shape[axis]
    if size < 2 * _CHUNK or size % _CHUNK:
        return _halve_max(x, axis)
    shape = x.shape
    chunks = x.reshape((*shape[:axis], size // _CHUNK, _CHUNK, *shape[axis + 1 :]))
    out = jnp.max(_halve_max(chunks, axis + 1), axis=axis, keepdims=True)
    return out.reshape((*shape[:axis], 1, *shape[axis + 1 :]))


def max_abs_tiles(
    x: jax.Array, tiles: Sequence[int], widen: Callable[[jax.Array], jax.Array]
) -> jax.Array:
    """max |x| inside every tile, in the dtype `widen` gives (exact); scale-shaped.

    Same values as `reduce_tiles(abs(x), tiles, jnp.max)`: a max is exact whatever the order of
    comparisons, so it is regrouped for XLA:CPU's sake (a sum could not be), and the result is
    never -0. Measured on 4096×4096 (bench/engine_bench.py), where jnp.max was up to ~10x slower:
      - the minor axis: max and min of x in its own dtype, then max(max, −min). jnp.max of |x|
        there is slow for short rows, and for bf16 its f32 |x| shares a convert with the
        quantizing loop, which XLA then materializes as a whole f32 copy of x.
      - other tile axes: halved (`_halve_max`); other fully reduced axes: `_max_full_axis`.
    """
    split, sub = _split_shape(x.shape, tiles)
    xs = x.reshape(split)
    full, tile_axes = [], []
    pos = 0
    for size, tile, s in zip(x.shape, tiles, sub, strict=True):
        if s >= 0:
            tile_axes.append(s)
        elif tile == size and tile != 1:
            full.append(pos)
        pos += 2 if s >= 0 else 1
    minor = xs.ndim - 1
    if minor in full or minor in tile_axes:
        hi = widen(jnp.max(xs, axis=minor, keepdims=True))
        lo = widen(jnp.min(xs, axis=minor, keepdims=True))
        out = jnp.maximum(hi, -lo)  # a column of zeros may give max(-0, +0) = -0: abs below
    else:
        # max(w, -w), not abs(w): the same value up to the sign of zero (fixed below), but not
        # an expression XLA merges with a caller's own abs(x) (leaf.py's statistics), which
        # would then be written out whole for both to read.
        wide = widen(xs)
        out = jnp.maximum(wide, -wide)
    for axis in sorted(set(full + tile_axes) - {minor}, reverse=True):
        out = _max_full_axis(out, axis) if axis in full else _halve_max(out, axis)
    return jnp.abs(out).reshape(scale_shape(x.shape, tiles))


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
