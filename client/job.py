"""The main job: read a checkpoint tensor by tensor, quantize, write the quantized checkpoint.

Integer and bool tensors are copied without a round trip; float tensors go to the backend (a
server or the embedded engine) and come back quantized or kept. The output appears under its
final name only when every tensor was written.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from qmill.client import checkpoints, recipes, streaming

# The engine quantizes only these; every other dtype is copied without a round trip.
QUANTIZABLE = frozenset({"float16", "bfloat16", "float32", "float64"})


class Backend(Protocol):
    def quantize(
        self, recipe: dict[str, Any], tensors: Any, **kwargs: Any
    ) -> Iterator[streaming.TensorOutcome]: ...


class Progress(Protocol):
    def start(self, total_bytes: int, total_tensors: int) -> None: ...
    def advance(self, nbytes: int) -> None: ...


@dataclasses.dataclass(frozen=True)
class ReportRow:
    path: str
    shape: tuple[int, ...]
    dtype: str
    # qtype for quantized tensors, "kept" otherwise.
    qtype: str
    sqnr_db: float
    mean_relative_error: float
    bytes_before: int
    bytes_after: int
    reason: str = ""
    tiles: str = ""


def quantize_checkpoint(
    source_path: str | os.PathLike,
    destination: str | os.PathLike,
    recipe: dict[str, Any],
    *,
    backend: Backend,
    output_format: str | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> list[ReportRow]:
    """Quantizes a checkpoint; returns one report row per tensor, in checkpoint order."""
    with checkpoints.open_source(source_path) as source:
        entries = source.entries()
        recipe = recipes.with_default_convention(recipe, source.format)
        to_send = [e for e in entries if _sendable(e.dtype)]
        if progress is not None:
            progress.start(sum(e.nbytes for e in entries), len(entries))
        rows: dict[str, ReportRow] = {}
        with checkpoints.create_writer(
            destination, output_format or source.format, like=source, overwrite=overwrite
        ) as writer:
            for entry in entries:
                if not _sendable(entry.dtype):
                    writer.write(entry.path, source.read(entry.path))
                    rows[entry.path] = _kept_row(
                        entry, f"{entry.dtype.name} tensors are never quantized"
                    )
                    if progress is not None:
                        progress.advance(entry.nbytes)

            def tensors() -> Iterator[tuple[str, np.ndarray]]:
                for entry in to_send:
                    yield entry.path, source.read(entry.path)

            by_path = {e.path: e for e in to_send}
            for outcome in backend.quantize(recipe, tensors()):
                entry = by_path[outcome.path]
                if outcome.quantized:
                    writer.write_quantized(outcome.path, outcome.parts)
                    rows[entry.path] = _quantized_row(entry, outcome)
                else:
                    assert outcome.array is not None
                    writer.write(outcome.path, outcome.array)
                    rows[entry.path] = _kept_row(entry, outcome.reason)
                if progress is not None:
                    progress.advance(entry.nbytes)
            missing = [e.path for e in to_send if e.path not in rows]
            if missing:
                raise RuntimeError(f"no result for {len(missing)} tensor(s), e.g. {missing[0]}")
    return [rows[e.path] for e in entries]


def _sendable(dtype: np.dtype) -> bool:
    return np.dtype(dtype).name in QUANTIZABLE


def _kept_row(entry: checkpoints.TensorEntry, reason: str) -> ReportRow:
    return ReportRow(
        path=entry.path,
        shape=tuple(entry.shape),
        dtype=entry.dtype.name,
        qtype="kept",
        sqnr_db=float("nan"),
        mean_relative_error=float("nan"),
        bytes_before=entry.nbytes,
        bytes_after=entry.nbytes,
        reason=reason,
    )


def _quantized_row(entry: checkpoints.TensorEntry, outcome: streaming.TensorOutcome) -> ReportRow:
    tiles = outcome.how.get("tiled_axes") or {}
    return ReportRow(
        path=entry.path,
        shape=tuple(entry.shape),
        dtype=entry.dtype.name,
        qtype=outcome.how.get("qtype", "?"),
        sqnr_db=outcome.sqnr_db,
        mean_relative_error=outcome.mean_relative_error,
        bytes_before=entry.nbytes,
        bytes_after=outcome.output_bytes,
        tiles=",".join(f"{a}:{t}" for a, t in tiles.items()),
    )
