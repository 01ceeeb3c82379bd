"""The plan of a run: what `qmill quantize` will do, decided once, before any work.

`make` turns (source, destination, recipe, output format) into a frozen Plan: the output format,
the recipe with its convention filled in, compressed-tensors' scheme, and every tensor's fate:
quantized (the engine's own LeafPlan, engine/modelfree/layout.plan_leaf: qtype, tiling, scale
dtype, NVFP4's global scale), kept and why, or copied (an integer or bool dtype); the shape the
engine quantizes it at (FP8_BLOCK's ragged weights padded to whole blocks); its bytes before and,
for --dry-run, after (the engine's quantizer traced abstractly: jax.eval_shape, no arithmetic).
Every refusal is raised here: a destination that would destroy the source, a recipe or source
the output format cannot hold, a tile that does not divide its axis.

The pipeline, --dry-run, the report, the writers (compressed-tensors' scheme and global scales),
the in-process engine (each tensor's LeafPlan, carried by `quantize_recipe`), calibration
coverage and the server's jobs read the plan and never the recipe again. A server and its replicas
get `quantize_recipe`, the one recipe that carries every decision (NVFP4's global scales
included), and plan each tensor they receive with the same engine function: a server trusts no
client's plan.

A run on a server that writes qmill's layout (`engine=False`) leaves each tensor's fate to the
server, so that this process never imports the engine (jax: a second or two).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import types
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from qmill.checkpoints.base import dtypes, protocols
from qmill.checkpoints.formats import registry as formats
from qmill.checkpoints.formats.compressed_tensors import blocks as ct_blocks
from qmill.checkpoints.formats.compressed_tensors import global_scales as ct_global
from qmill.checkpoints.formats.compressed_tensors import schemes as ct_schemes
from qmill.checkpoints.formats.compressed_tensors import writer as ct_writer
from qmill.checkpoints.formats.hf_folder import untied as hf_untied
from qmill.checkpoints.run import rows as rows_lib

# The engine quantizes only these; every other dtype is copied without a round trip.
QUANTIZABLE = frozenset({"float16", "bfloat16", "float32", "float64"})


class PlannedRecipe(dict):
    """A recipe (the mapping every backend takes) that carries the plan's decision for each
    tensor: the in-process engine quantizes with `leaves` instead of reading the rules again; a
    server reads it as the plain mapping it is."""

    def __init__(self, recipe: Mapping[str, Any], leaves: dict[str, Any]) -> None:
        super().__init__(recipe)
        # Tensor path -> its LeafPlan (engine/modelfree/layout.py), for every float tensor.
        self.leaves = leaves


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    """One tensor's fate."""

    # As the source stores it (and the output, where it is kept or copied).
    entry: protocols.TensorEntry
    # As the engine quantizes it: `entry`, or FP8_BLOCK's ragged weight padded to whole blocks.
    view: protocols.TensorEntry
    # The engine's LeafPlan; None for a dtype that is never quantized, or where the backend
    # decides (a run on a server).
    leaf: Any = None
    # Why it is never sent (its dtype) or kept (the leaf's reason); "" otherwise.
    reason: str = ""
    # Bytes as stored after (4-bit codes two to a byte), predicted for a dry run; None until the
    # run measures them.
    bytes_after: int | None = None

    @property
    def path(self) -> str:
        return self.entry.path

    @property
    def sent(self) -> bool:
        """Whether the run sends it to the backend: quantized, or for the backend to decide."""
        if self.leaf is not None:
            return self.leaf.quantize
        return self.entry.dtype.name in QUANTIZABLE

    @property
    def quantized(self) -> bool:
        return self.leaf is not None and self.leaf.quantize


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every decision of one run (see the module doc). Never mutated."""

    source: str
    destination: str
    source_format: str
    # The output format ("orbax", "safetensors", "npz", "compressed-tensors").
    format: str
    overwrite: bool
    # The recipe as asked, its convention filled in from the source's format (the report's).
    recipe: dict[str, Any]
    # What the backend quantizes with and a resumed run's fingerprint records: `recipe`, with
    # NVFP4's global-scale rules ahead of its own; a PlannedRecipe when `resolved`.
    quantize_recipe: dict[str, Any]
    # compressed-tensors' scheme; None for qmill's layout.
    scheme: ct_schemes.Scheme | None
    tensors: tuple[TensorPlan, ...]
    # Whether each tensor's fate was decided here (else by the backend: a run on a server).
    resolved: bool
    # (head, embedding): a Hugging Face folder's tied head written as a tensor of its own
    # (hf_folder/untied.py; a rotated language model's), or None.
    untie: tuple[str, str] | None = None

    @contextlib.contextmanager
    def opened(self) -> Iterator[protocols.TensorSource]:
        """The source as planned (its head untied where `untie` says)."""
        with formats.open_source(self.source) as source:
            yield hf_untied.untied(source, self.untie)

    @functools.cached_property
    def by_path(self) -> Mapping[str, TensorPlan]:
        return types.MappingProxyType({t.path: t for t in self.tensors})

    @property
    def global_scales(self) -> dict[str, float]:
        """NVFP4: {tensor path: its global scale}; {} otherwise."""
        return {
            t.path: t.leaf.global_scale
            for t in self.tensors
            if t.quantized and t.leaf.global_scale is not None
        }

    def view(self, source: protocols.TensorSource) -> Any:
        """`source` as the engine quantizes it: FP8_BLOCK's ragged weights read zero-padded."""
        padded = {t.path: t.view for t in self.tensors if t.view is not t.entry}
        return ct_blocks.PaddedSource(source, padded) if padded else source

    def rows(self) -> list[rows_lib.ReportRow]:
        """A row per tensor as a run reports it, without what only a run measures (SQNR; the
        bytes after, unless predicted)."""
        out = []
        for t in self.tensors:
            if not t.quantized:
                out.append(rows_lib.kept_row(t.entry, t.reason))
                continue
            row = rows_lib.ReportRow(
                path=t.path,
                shape=t.view.shape,
                dtype=t.view.dtype.name,
                qtype=t.leaf.qtype,
                sqnr_db=float("nan"),
                mean_relative_error=float("nan"),
                bytes_before=t.view.nbytes,
                bytes_after=t.view.nbytes if t.bytes_after is None else t.bytes_after,
                tiles=rows_lib.tiles_text(t.leaf.tiled_axes),
            )
            out.append(stored_row(t, row))
        return out


def stored_row(tensor: TensorPlan, row: rows_lib.ReportRow) -> rows_lib.ReportRow:
    """A row of a weight quantized padded (FP8_BLOCK), as stored: its own shape and bytes (the
    padding's codes, one byte each in fp8, are not written)."""
    if tensor.view is tensor.entry:
        return row
    padding = math.prod(tensor.view.shape) - math.prod(tensor.entry.shape)
    return dataclasses.replace(
        row,
        shape=tuple(tensor.entry.shape),
        bytes_before=tensor.entry.nbytes,
        bytes_after=row.bytes_after - padding,
    )


def make(
    source_path: str | os.PathLike,
    destination: str | os.PathLike,
    recipe: dict[str, Any],
    output_format: str | None = None,
    *,
    overwrite: bool = False,
    engine: bool = True,
    dry_run: bool = False,
    untie: tuple[str, str] | None = None,
) -> Plan:
    """The plan of quantizing `source_path` into `destination` with `recipe` (a mapping).

    `engine`: decide each tensor's fate here (False: a run on a server writing qmill's layout,
    whose server decides; compressed-tensors always decides here). `dry_run`: predict each
    quantized tensor's bytes after, and read no tensor (NVFP4's global scales are left out).
    `untie`: (head, embedding) of a Hugging Face folder whose tied head the output holds as a
    tensor of its own (hf_folder/untied.py), written from the run's `replaced`.

    Raises:
        ValueError: the destination would destroy the source or has a suffix qmill does not
            write; the recipe is malformed; the output format cannot hold the source or the
            recipe; a tile does not divide its axis.
        FileExistsError: the destination exists and `overwrite` is False.
        FileNotFoundError: no source.
    """
    options = {"overwrite": overwrite, "engine": engine, "dry_run": dry_run, "untie": untie}
    with opened(source_path, destination, recipe, output_format, **options) as (plan, _):
        return plan


@contextlib.contextmanager
def opened(
    source_path: str | os.PathLike,
    destination: str | os.PathLike,
    recipe: dict[str, Any],
    output_format: str | None = None,
    **options: Any,
) -> Iterator[tuple[Plan, protocols.TensorSource]]:
    """`make`'s plan (`options`: its keyword arguments), and its source still open for the
    run (the pipeline's)."""
    formats.check_destination(
        source_path,
        destination,
        overwrite=options.get("overwrite", False),
        output_format=output_format,
    )
    with formats.open_source(source_path) as opened_source:
        source = hf_untied.untied(opened_source, options.get("untie"))
        yield (
            plan_source(source, source_path, destination, recipe, output_format, **options),
            source,
        )


def plan_source(
    source: protocols.TensorSource,
    source_path: str | os.PathLike,
    destination: str | os.PathLike,
    recipe: dict[str, Any],
    output_format: str | None,
    *,
    overwrite: bool = False,
    engine: bool = True,
    dry_run: bool = False,
    untie: tuple[str, str] | None = None,
) -> Plan:
    """`make` over an opened source (the destination already checked; its head already
    untied where `untie` says)."""
    fmt = output_format or formats.format_for_destination(destination, source.format)
    recipe = with_default_convention(recipe, source.format)
    scheme = None
    if fmt == formats.COMPRESSED_TENSORS:
        ct_writer.check_source(source, recipe)
        scheme = ct_schemes.scheme_of_recipe(recipe)
    plan = Plan(
        source=str(source_path),
        destination=str(destination),
        source_format=source.format,
        format=fmt,
        overwrite=overwrite,
        recipe=recipe,
        quantize_recipe=recipe,
        scheme=scheme,
        tensors=tuple(_unresolved(e) for e in source.entries()),
        resolved=False,
        untie=untie,
    )
    if not engine and scheme is None:
        return plan
    return _resolve(plan, source, dry_run)


def with_default_convention(recipe: dict[str, Any], source_format: str) -> dict[str, Any]:
    """Fills in the convention from the checkpoint format when the recipe does not set one:
    safetensors checkpoints come from PyTorch, Orbax and npz from Flax."""
    if "convention" in recipe:
        return recipe
    return {**recipe, "convention": "torch" if source_format == "safetensors" else "flax"}


def _unresolved(entry: protocols.TensorEntry) -> TensorPlan:
    if entry.dtype.name in QUANTIZABLE:
        return TensorPlan(entry, entry)
    return TensorPlan(entry, entry, reason=f"{entry.dtype.name} tensors are never quantized")


def _resolve(plan: Plan, source: protocols.TensorSource, dry_run: bool) -> Plan:
    """`plan` with each float tensor's LeafPlan, the engine's (imported here: jax)."""
    from qmill.engine.modelfree import recipes  # lazy: pulls in jax

    engine_recipe = recipes.recipe_from_mapping(plan.recipe)
    block = ct_blocks.block_of(plan.scheme)
    tensors = [
        t if t.reason else _tensor(t.entry, engine_recipe, plan.scheme, block) for t in plan.tensors
    ]
    scales = {}
    if plan.scheme is not None and not dry_run:
        quantized = [t.entry for t in tensors if t.quantized]
        scales = ct_global.find(source, plan.scheme, quantized)
    tensors = [_with_global_scale(t, scales.get(t.path)) for t in tensors]
    if dry_run:
        tensors = _with_predicted_bytes(tensors)
    quantize_recipe = PlannedRecipe(
        ct_global.with_rules(plan.recipe, plan.scheme, scales) if scales else plan.recipe,
        {t.path: t.leaf for t in tensors if t.leaf is not None},
    )
    return dataclasses.replace(
        plan, quantize_recipe=quantize_recipe, tensors=tuple(tensors), resolved=True
    )


def _tensor(
    entry: protocols.TensorEntry,
    engine_recipe: Any,
    scheme: ct_schemes.Scheme | None,
    block: tuple[int, int] | None,
) -> TensorPlan:
    """One float tensor's fate: the engine's plan of it, at its padded shape where a block
    scheme pads it (and kept at its own where the plan keeps it)."""
    from qmill.engine.modelfree import layout  # lazy: pulls in jax

    padded = ct_blocks.padded_shape(entry.path, entry.shape, block)
    try:
        leaf = layout.plan_leaf(entry.path, padded or entry.shape, entry.dtype, engine_recipe)
    except ValueError as e:
        if scheme is None:
            raise
        raise ct_writer.tile_refusal(scheme, e) from None
    view = entry
    if padded is not None and leaf.quantize:
        view = protocols.entry(entry.path, entry.dtype, padded)
    if scheme is not None:
        ct_writer.check_tensor(entry.path, view.shape, leaf.quantize)
    return TensorPlan(entry, view, leaf, reason="" if leaf.quantize else leaf.reason)


def _with_global_scale(tensor: TensorPlan, scale: float | None) -> TensorPlan:
    if scale is None:
        return tensor
    return dataclasses.replace(tensor, leaf=dataclasses.replace(tensor.leaf, global_scale=scale))


def _with_predicted_bytes(tensors: list[TensorPlan]) -> list[TensorPlan]:
    """The tensors with the bytes a run would write for each quantized one. A model repeats a
    few shapes layer after layer: each (shape, dtype, plan) is traced once."""
    sizes: dict[Any, int] = {}
    out = []
    for t in tensors:
        if t.quantized:
            key = (t.view.shape, t.view.dtype, dataclasses.replace(t.leaf, path="", reason=""))
            if key not in sizes:
                sizes[key] = _output_bytes(t.view, t.leaf)
            t = dataclasses.replace(t, bytes_after=sizes[key])
        out.append(t)
    return out


def _output_bytes(entry: protocols.TensorEntry, plan: Any) -> int:
    """Bytes of qvalue, scale and zero point as stored (4-bit codes two to a byte)."""
    import jax

    from qmill.engine.core import qarray_parts, qtypes

    how = qarray_parts.HowToQuantize(
        qtype=plan.qtype,
        channelwise_axes=plan.channelwise_axes,
        tiled_axes=dict(plan.tiled_axes),
        calibration_method=plan.calibration_method,
    )
    spec = jax.ShapeDtypeStruct(entry.shape, entry.dtype)
    qvalue, scale, zero_point = jax.eval_shape(
        lambda x: qarray_parts.quantize_bytes(x, how, scale_dtype=plan.scale_dtype), spec
    )
    storage = qtypes.get(plan.qtype).storage
    total = dtypes.packed_nbytes(np.dtype(storage), tuple(qvalue.shape))
    for part in (scale, zero_point):
        if part is not None:
            total += dtypes.packed_nbytes(np.dtype(part.dtype), tuple(part.shape))
    return total


def plan_checkpoint(
    source_path: str | os.PathLike, recipe: dict[str, Any], output_format: str | None = None
) -> list[rows_lib.ReportRow]:
    """One ReportRow per tensor, as a run with `recipe` would report it (without SQNR): its
    qtype and tiling or the reason it is kept, and its bytes before and after (`qmill quantize
    --dry-run`'s table)."""
    with formats.open_source(source_path) as source:
        planned = plan_source(source, source_path, "", recipe, output_format, dry_run=True)
    return planned.rows()
