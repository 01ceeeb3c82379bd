"""What a run reports per tensor: one ReportRow each, from the plan (a tensor never sent, or
kept) or from the backend's outcome (a quantized tensor, its quality measured)."""

from __future__ import annotations

import dataclasses
from typing import Any

from qmill.checkpoints.base import protocols
from qmill.checkpoints.run import outcome as outcome_lib


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
    # What quantized it when a calibration was given: "GPTQ", "AWQ", "SmoothQuant" or "RTN"
    # (round to nearest: no statistics for it); "" otherwise.
    method: str = ""
    # GPTQ's output SQNR, and round to nearest's (outcome.py); NaN where not measured.
    output_sqnr_db: float = float("nan")
    rtn_output_sqnr_db: float = float("nan")


def row_fields(info: dict[str, Any]) -> dict[str, Any]:
    """A row's fields as a partial output recorded them (JSON: the shape a list)."""
    return dict(info, shape=tuple(info["shape"]))


def kept_row(entry: protocols.TensorEntry, reason: str) -> ReportRow:
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


def tiles_text(tiled_axes: Any) -> str:
    """ "axis:tile,..." of a plan's or an outcome's tiled axes (pairs or a mapping)."""
    pairs = tiled_axes.items() if isinstance(tiled_axes, dict) else tiled_axes or ()
    return ",".join(f"{a}:{t}" for a, t in pairs)


def quantized_row(entry: protocols.TensorEntry, outcome: outcome_lib.TensorOutcome) -> ReportRow:
    return ReportRow(
        path=entry.path,
        shape=tuple(entry.shape),
        dtype=entry.dtype.name,
        qtype=outcome.how.get("qtype", "?"),
        sqnr_db=outcome.sqnr_db,
        mean_relative_error=outcome.mean_relative_error,
        bytes_before=entry.nbytes,
        bytes_after=outcome.output_bytes,
        tiles=tiles_text(outcome.how.get("tiled_axes") or {}),
        output_sqnr_db=outcome.output_sqnr_db,
        rtn_output_sqnr_db=outcome.rtn_output_sqnr_db,
    )
