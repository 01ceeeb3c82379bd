"""Which of a checkpoint's tensors a calibration's statistics cover, checked before any work.

A calibrated method (GPTQ, AWQ, SmoothQuant) quantizes the tensors its statistics name; every
other quantized tensor is rounded to nearest (RTN). Statistics that name none of the tensors a
recipe quantizes (a model whose parameter paths are not the checkpoint's, another model's
statistics) would leave a plain RTN output that looks calibrated: refused here instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qmill.checkpoints.run import plan as plan_lib

# The report's name for a quantized tensor that had no statistics: round to nearest.
RTN = "RTN"
SHOWN = 3  # names quoted in a message, of each kind


def _some(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN])
    return shown + (f", ... ({len(names)} in all)" if len(names) > SHOWN else "")


def methods_by_tensor(
    plan: plan_lib.Plan, stats: Mapping[str, Any], what: str
) -> tuple[dict[str, str], list[str]]:
    """({tensor path: method} for every tensor the run's `plan` (plan.py) quantizes, the
    quantized tensors without statistics) for the statistics `stats` (`what` names them in
    messages). A method is "GPTQ", "AWQ", "SmoothQuant" or RTN; a checkpoint's leading
    "params/" level matches a model's parameter path without it, as the quantizer matches them.

    Raises:
        ValueError: the statistics name none of the tensors the recipe quantizes.
    """
    from qmill.engine.contrib import leaf  # lazy: the methods' names, as the quantizer reads them

    quantized = [t.path for t in plan.tensors if t.quantized]
    by_param = {path: leaf.NAMES[method] for path, (method, _) in leaf.method_stats(stats).items()}
    methods, missing = {}, []
    for path in quantized:
        method = by_param.get(path) or by_param.get(path.removeprefix("params/"))
        methods[path] = method or RTN
        if method is None:
            missing.append(path)
    if quantized and len(missing) == len(quantized):
        raise ValueError(
            f"{what}: its statistics name none of the {len(quantized)} tensors the recipe "
            f"quantizes, which would all be rounded to nearest as without it. Statistics for: "
            f"{_some(sorted(by_param)) or 'nothing (no GPTQ, AWQ or SmoothQuant statistic)'}; "
            f"tensors: {_some(quantized)}. Calibrate the model whose parameters are this "
            "checkpoint's tensors (the same paths), or leave out --calibration"
        )
    return methods, missing


def missing_note(missing: list[str], total: int) -> str:
    """The line that says which quantized tensors had no statistics (rounded to nearest)."""
    return (
        f"qmill: {len(missing)} of {total} quantized tensors have no statistics in the "
        f"calibration: they are rounded to nearest (RTN): {_some(missing)}"
    )
