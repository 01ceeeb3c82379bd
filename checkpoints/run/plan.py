"""`qmill quantize --dry-run`: what a recipe would do to each tensor, without quantizing.

The plan comes from the engine's own rule matching and layout inference (engine.layout.plan_leaf,
the function the embedded engine and the server quantize with), and the output's shapes from
tracing the engine's quantizer abstractly (jax.eval_shape: shapes and dtypes, no arithmetic), so
the bytes it predicts are those a real run writes. Nothing is read but the checkpoint's header,
and nothing is written. The engine and JAX are imported on first use.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from qmill.checkpoints.base import dtypes
from qmill.checkpoints.formats import registry as formats
from qmill.checkpoints.formats.compressed_tensors import blocks as ct_blocks
from qmill.checkpoints.run import pipeline


def plan_checkpoint(source_path: str | os.PathLike, recipe: dict[str, Any]) -> list[Any]:
    """One pipeline.ReportRow per tensor, as a run with `recipe` would report it (without
    SQNR): its qtype and tiling or the reason it is kept, and its bytes before and after.

    Raises:
        ValueError: the recipe is malformed, or a tensor's plan is refused (a tile that does not
            divide its axis), as the run itself would.
    """
    from qmill.engine.modelfree import (
        layout,
        recipes,  # lazy: pulls in jax
    )

    with formats.open_source(source_path) as source:
        recipe = pipeline.with_default_convention(recipe, source.format)
        # A compressed-tensors scheme's run quantizes ragged blocks padded (ct_blocks).
        view = ct_blocks.padded_view(source, recipe)
        entries = view.entries()
    engine_recipe = recipes.recipe_from_mapping(recipe)
    rows = []
    # A model repeats a few shapes layer after layer: trace each (shape, dtype, plan) once.
    sizes: dict[Any, int] = {}
    for entry in entries:
        plan = layout.plan_leaf(entry.path, entry.shape, entry.dtype, engine_recipe)
        after = entry.nbytes
        if plan.quantize:
            key = (tuple(entry.shape), entry.dtype, dataclasses.replace(plan, path="", reason=""))
            if key not in sizes:
                sizes[key] = _output_bytes(entry, plan)
            after = sizes[key]
        row = pipeline.ReportRow(
            path=entry.path,
            shape=tuple(entry.shape),
            dtype=entry.dtype.name,
            qtype=plan.qtype if plan.quantize else "kept",
            sqnr_db=float("nan"),
            mean_relative_error=float("nan"),
            bytes_before=entry.nbytes,
            bytes_after=after,
            reason=plan.reason,
            tiles=",".join(f"{a}:{t}" for a, t in plan.tiled_axes),
        )
        if isinstance(view, ct_blocks.PaddedSource):
            row = view.as_stored(entry.path, row)
        rows.append(row)
    return rows


def _output_bytes(entry: Any, plan: Any) -> int:
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
