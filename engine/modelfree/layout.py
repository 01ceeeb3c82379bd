"""Model-free layout inference: which axes of a checkpoint tensor contract and which are channels.

Lingo: a weight `w` meets activations in a matmul or convolution. Its *contracting* axes are
summed over (a Dense kernel's input features); its *channel* axes index outputs (one scale each);
the *tile axis* is the contracting axis that sub-channel quantization splits into blocks.

Without the model, the layout comes from the tensor's name, rank and the checkpoint convention:
- Flax `kernel` (in, out); DenseGeneral (in, out...) ; conv HWIO and its 1-D/3-D siblings.
- PyTorch `weight` (out, in); conv (O, I, spatial...).
- `embedding`/`embed_tokens`-like tables (rows, features): one scale per row.
A rule's explicit contracting/channel axes override all of this.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from qmill.engine.modelfree import recipes

FLOAT_KINDS = ("float16", "bfloat16", "float32", "float64")


@dataclasses.dataclass(frozen=True)
class Layout:
    contracting_axes: tuple[int, ...]
    channel_axes: tuple[int, ...]
    tile_axis: int | None


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """What to do with one tensor: quantize with these arguments, or keep it (and why)."""

    path: str
    qtype: str | None = None
    channelwise_axes: tuple[int, ...] = ()
    tiled_axes: tuple[tuple[int, int], ...] = ()
    calibration_method: str = "absmax"
    scale_dtype: str | None = None
    reason: str = ""
    arithmetic: str = ""
    global_scale: float | None = None

    @property
    def quantize(self) -> bool:
        return self.qtype is not None


_EMBEDDING = re.compile(r"(embedding|embed_tokens|wte|wpe|word_embeddings|embed)$", re.I)
_CONV = re.compile(r"conv", re.I)


def _leaf_name(path: str) -> str:
    return re.split(r"[/.]", path)[-1]


def infer_layout(path: str, shape: tuple[int, ...], convention: str) -> Layout:
    """The layout of a weight tensor of rank >= 2, from its path, shape and convention."""
    ndim = len(shape)
    name = _leaf_name(path)
    if _EMBEDDING.search(name) or (name == "weight" and _EMBEDDING.search(path.rsplit(".", 1)[0])):
        return Layout(contracting_axes=tuple(range(1, ndim)), channel_axes=(0,), tile_axis=ndim - 1)
    torch = name == "weight" or (name != "kernel" and convention == "torch")
    if torch:
        # (out, in, spatial...): conv kernels contract the input channel and spatial axes.
        return Layout(contracting_axes=tuple(range(1, ndim)), channel_axes=(0,), tile_axis=1)
    if ndim >= 4 or (ndim == 3 and _CONV.search(path)):
        # Flax conv (spatial..., in, out).
        return Layout(
            contracting_axes=tuple(range(ndim - 1)), channel_axes=(ndim - 1,), tile_axis=ndim - 2
        )
    # Flax Dense (in, out) and DenseGeneral (in, out...): the first axis contracts.
    return Layout(contracting_axes=(0,), channel_axes=tuple(range(1, ndim)), tile_axis=0)


def _normalize_axes(axes: tuple[int, ...], ndim: int, path: str) -> tuple[int, ...]:
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"{path}: axis {a} is out of range for a rank-{ndim} tensor")
        out.append(a % ndim)
    return tuple(sorted(set(out)))


def plan_leaf(
    path: str, shape: tuple[int, ...], dtype: np.dtype | str, recipe: recipes.Recipe
) -> LeafPlan:
    """Decides how one tensor is quantized. Pure: looks at names and shapes, never at values."""
    dtype_name = np.dtype(dtype).name
    rule = recipe.rule_for(path)
    if dtype_name not in FLOAT_KINDS:
        return LeafPlan(path, reason=f"{dtype_name} tensors are never quantized")
    if rule is None:
        return LeafPlan(path, reason="no rule matches")
    if rule.skip:
        return LeafPlan(path, reason=f"skipped by rule {rule.path_regex!r}")
    ndim = len(shape)
    if ndim < 2 and not rule.include_vectors:
        return LeafPlan(path, reason="vectors and scalars stay in float (include_vectors=false)")
    if 0 in shape:
        # Nothing to calibrate (rms divided by zero; scale shapes could not divide a 0 axis):
        # an empty tensor is the same bytes kept or quantized, so it is kept.
        return LeafPlan(path, reason=f"empty tensor (shape {list(shape)}) is kept as it is")
    if rule.channel_axes is not None:
        contracting = _normalize_axes(rule.contracting_axes or (), ndim, path)
        channels = _normalize_axes(rule.channel_axes, ndim, path)
        layout = Layout(contracting, channels, contracting[-1] if contracting else None)
    elif ndim < 2:
        layout = Layout(tuple(range(ndim)), (), ndim - 1 if ndim else None)
    else:
        layout = infer_layout(path, shape, recipe.convention)
    tiled = _tiles(path, shape, rule, layout)
    channelwise = tuple(a for a in layout.channel_axes if a not in dict(tiled))
    return LeafPlan(
        path,
        qtype=rule.qtype,
        channelwise_axes=channelwise,
        tiled_axes=tiled,
        calibration_method=rule.calibration_method,
        scale_dtype=rule.scale_dtype,
        arithmetic=rule.arithmetic,
        global_scale=rule.global_scale,
    )


def _tiles(
    path: str, shape: tuple[int, ...], rule: recipes.TensorRule, layout: Layout
) -> tuple[tuple[int, int], ...]:
    ndim = len(shape)
    if rule.tiled_axes is not None:
        tiles = []
        for axis, tile in rule.tiled_axes:
            (axis,) = _normalize_axes((axis,), ndim, path)
            _check_divides(path, shape, axis, tile)
            tiles.append((axis, tile))
        return tuple(sorted(tiles))
    if rule.tile_size is None or layout.tile_axis is None:
        return ()
    axis, tile = layout.tile_axis, rule.tile_size
    if shape[axis] % tile:
        if rule.tile_if_divisible:
            return ()
        _check_divides(path, shape, axis, tile)
    return ((axis, tile),)


def _check_divides(path: str, shape: tuple[int, ...], axis: int, tile: int) -> None:
    if tile <= 0 or shape[axis] % tile:
        raise ValueError(
            f"{path}: tile size {tile} does not divide axis {axis} of shape {list(shape)}; "
            "pick a tile that divides it, or set tile_if_divisible"
        )
