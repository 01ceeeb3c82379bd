"""Flax parameters saved as a training script saves them: one npz of '/'-joined tree keys under
"params/" (what `qmill upload`, `calibrate` and `quantize` read in the CLI tests)."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np


def save(path: pathlib.Path, params: Any) -> None:
    """Writes `params` (a nested dict of arrays, without the "params" level) to `path`."""
    np.savez(path, **{f"params/{k}": v for k, v in _flat(params).items()})


def _flat(tree: Any, prefix: str = "") -> dict[str, np.ndarray]:
    if not isinstance(tree, dict) and not hasattr(tree, "items"):
        return {prefix[:-1]: np.asarray(tree)}
    flat = {}
    for key, value in tree.items():
        flat.update(_flat(value, f"{prefix}{key}/"))
    return flat
