"""What became of one tensor sent for quantization: the record every backend hands back.

The embedded engine, one server and a fan-out over several all yield TensorOutcome, so the
checkpoint pipeline (pipeline.py) writes the same checkpoint whichever did the work.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from qmill.checkpoints.base import dtypes


@dataclasses.dataclass(frozen=True)
class TensorOutcome:
    """What became of one tensor sent for quantization."""

    path: str
    # True: quantized, `parts` holds qvalue, scale (and zero_point); 4-bit qvalues come packed
    # as they are stored (dtypes.Packed4; np.asarray unpacks). False: kept; `parts` is empty, or
    # holds "value" when a server sent a float tensor the caller does not have.
    quantized: bool
    parts: dict[str, np.ndarray | dtypes.Packed4]
    reason: str = ""
    # qtype, channelwise_axes, tiled_axes, calibration_method.
    how: dict[str, Any] = dataclasses.field(default_factory=dict)
    sqnr_db: float = float("nan")
    mean_relative_error: float = float("nan")
    input_bytes: int = 0
    # A calibrated method's output SQNR, and round to nearest's on the same inputs (in-process
    # GPTQ: engine/modelfree/leaf.Quality); NaN where not measured.
    output_sqnr_db: float = float("nan")
    rtn_output_sqnr_db: float = float("nan")

    @property
    def output_bytes(self) -> int:
        if not self.quantized:
            return self.input_bytes
        return sum(dtypes.packed_nbytes(p.dtype, p.shape) for p in self.parts.values())
