"""Behaviour every writer shares: the context manager, the quantized-leaf layout, the guards.

A format implements `_put(key, array, origin)`, `_commit()` and `_abort()`. `origin` is the
source path a tensor belongs to (the leaf P for P/array/qvalue), which the sharded safetensors
writer uses to keep every output tensor in the shard of its input.

One key layout in every format: a quantized leaf P becomes P/array/qvalue, P/array/scale and
P/array/zero_point, '/'-joined whatever the format, P being the source's own path verbatim
(a safetensors name keeps its dots: "model.layers.0.mlp.up_proj.weight/array/qvalue"); an AWQ or
SmoothQuant leaf also P/awq_scale or P/inv_sq_scale, beside P/array.
"""

from __future__ import annotations

import numpy as np

from qmill.checkpoints.base import dtypes

# The parts of a quantized leaf, in the order they are written (Qwix's QArray fields).
QUANTIZED_PARTS = ("qvalue", "scale", "zero_point")
# Per-channel parts a calibrated method keeps beside the QArray, at P/<name> (not in P/array),
# where the reference's param tree has them: AWQ's WithAwqScale.awq_scale, SmoothQuant's
# WithSqScale.inv_sq_scale (docs/calibrated-methods.md). At most one per leaf. By part: the
# calibrated method that makes it.
BESIDE_PARTS = {"awq_scale": "awq", "inv_sq_scale": "smoothquant"}


# Joins a quantized leaf's path to the parts qmill adds, in every format.
SEPARATOR = "/"


def quantized_key(path: str, part: str) -> str:
    """Where part `part` of quantized leaf `path` is stored: path/array/part."""
    return SEPARATOR.join((path, "array", part))


class WriterBase:
    def __init__(self) -> None:
        self._state = "open"
        self._keys: set[str] = set()

    # The format's work.
    def _put(self, key: str, array: np.ndarray, origin: str) -> None:
        raise NotImplementedError

    def _commit(self) -> None:
        raise NotImplementedError

    def _abort(self) -> None:
        raise NotImplementedError

    # The public protocol.
    def write(self, path: str, array: np.ndarray) -> None:
        self._add(path, np.asarray(array), path)

    def write_as(self, key: str, array: np.ndarray, origin: str) -> None:
        """Writes `array` under `key`, placed (in a sharded output) with source tensor `origin`:
        for layouts other than P/array/* (compressed-tensors' M.weight_packed, ...)."""
        self._add(key, np.asarray(array), origin)

    def write_quantized(self, path: str, parts: dict[str, np.ndarray]) -> None:
        unknown = set(parts) - set(QUANTIZED_PARTS) - set(BESIDE_PARTS)
        beside = [name for name in BESIDE_PARTS if name in parts]
        if unknown or not {"qvalue", "scale"} <= set(parts) or len(beside) > 1:
            raise ValueError(
                f"{path}: quantized parts are qvalue, scale and optionally zero_point, and at "
                f"most one of {', '.join(BESIDE_PARTS)}; got {sorted(parts)}"
            )
        for name in QUANTIZED_PARTS:
            if name in parts:
                key = quantized_key(path, name)
                # Packed 4-bit codes (dtypes.Packed4) go to the format as they are.
                self._add(key, dtypes.packed_or_array(parts[name]), path)
        for name in beside:
            self._add(SEPARATOR.join((path, name)), np.asarray(parts[name]), path)

    def commit(self) -> None:
        self._check_open()
        try:
            self._commit()
        except BaseException:
            self.abort()
            raise
        self._state = "committed"

    def abort(self) -> None:
        if self._state == "open":
            self._state = "aborted"
            self._abort()

    def __enter__(self) -> WriterBase:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._state != "open":
            return  # committed or aborted explicitly inside the block
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def _add(self, key: str, array: np.ndarray, origin: str) -> None:
        self._check_open()
        if not key:
            raise ValueError("a tensor needs a non-empty path")
        if key in self._keys:
            raise ValueError(f"tensor {key} written twice")
        if array.dtype.hasobject:
            raise ValueError(f"{key}: object arrays cannot be stored in a checkpoint")
        self._keys.add(key)
        self._put(key, array, origin)

    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"this checkpoint writer is already {self._state}")
