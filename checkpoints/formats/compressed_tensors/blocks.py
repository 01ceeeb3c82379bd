"""FP8_BLOCK on weights whose sides are not multiples of the block (128 x 128).

compressed-tensors quantizes such a weight as if it were padded with zeros up to whole blocks
(`maybe_pad_tensor_for_block_quant`), stores the codes at the weight's own shape and one scale
per block, ceil(out/128) x ceil(in/128). A MoE router (Mixtral's `gate`, (experts, hidden)) or a
model of hidden size 576 has such weights. The engine tiles only whole blocks, so the source is
seen through `padded_view`: each weight the scheme quantizes whose sides do not divide reads as
its zero-padded copy, and the writer keeps the codes of the weight's own rows and columns
(`unpad`). Zeros change no block's absolute maximum, so the scales are those of the partial
blocks, bit for bit what llm-compressor writes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from qmill.checkpoints.base import protocols
from qmill.checkpoints.formats.compressed_tensors import schemes as ct_schemes


def block_of(recipe: dict[str, Any]) -> tuple[int, int] | None:
    """The (rows, cols) block of a recipe carrying a block scheme (FP8_BLOCK); None otherwise."""
    try:
        scheme = ct_schemes.scheme_of_recipe(recipe)
    except ValueError:
        return None
    tiles = scheme.rule.get("tiled_axes") or {}
    if 0 in tiles and 1 in tiles:
        return int(tiles[0]), int(tiles[1])
    return None


def _padded(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    return tuple(-(-n // b) * b for n, b in zip(shape, block, strict=True))


def padded_entries(
    entries: list[protocols.TensorEntry], recipe: dict[str, Any]
) -> dict[str, protocols.TensorEntry]:
    """The entries the scheme quantizes whose sides a block does not divide, at their padded
    shapes, by path (none for other recipes)."""
    from qmill.engine.modelfree import layout, recipes  # lazy: pulls in jax

    block = block_of(recipe)
    if block is None:
        return {}
    engine_recipe = recipes.recipe_from_mapping(recipe)
    out = {}
    for e in entries:
        if len(e.shape) != 2 or not e.path.endswith(".weight"):
            continue
        shape = _padded(e.shape, block)
        if shape == tuple(e.shape):
            continue
        if layout.plan_leaf(e.path, shape, e.dtype, engine_recipe).quantize:
            out[e.path] = protocols.entry(e.path, e.dtype, shape)
    return out


class PaddedSource:
    """`source` with the weights of `padded` read as their zero-padded copies."""

    def __init__(self, source: Any, padded: dict[str, protocols.TensorEntry]) -> None:
        self._source = source
        self._padded = padded
        self._own = {e.path: e for e in source.entries() if e.path in padded}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    def entries(self) -> list[protocols.TensorEntry]:
        return [self._padded.get(e.path, e) for e in self._source.entries()]

    def read(self, path: str) -> np.ndarray:
        array = self._source.read(path)
        entry = self._padded.get(path)
        if entry is None:
            return array
        out = np.zeros(entry.shape, array.dtype)
        out[: array.shape[0], : array.shape[1]] = array
        return out

    def as_stored(self, path: str, row: Any) -> Any:
        """A report row of the padded weight, as the stored one: its own shape and bytes (the
        padding's codes, one byte each in fp8, are not written)."""
        entry, own = self._padded.get(path), self._own.get(path)
        if entry is None or own is None:
            return row
        padding = math.prod(entry.shape) - math.prod(own.shape)
        return dataclasses.replace(
            row,
            shape=tuple(own.shape),
            bytes_before=own.nbytes,
            bytes_after=row.bytes_after - padding,
        )

    def __enter__(self) -> PaddedSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self._source.__exit__(*exc)


def padded_view(source: Any, recipe: dict[str, Any]) -> Any:
    """`source` as the engine must see it for `recipe`: itself, unless a block scheme needs
    some weights padded."""
    padded = padded_entries(source.entries(), recipe)
    return PaddedSource(source, padded) if padded else source


def unpad(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The codes (or a kept weight) of the weight's own rows and columns."""
    if tuple(np.shape(array)) == tuple(shape):
        return array
    return np.asarray(array)[tuple(slice(0, n) for n in shape)]
