"""Behaviour every writer shares: the context manager, the quantized-leaf layout, the guards.

A format implements `_put(key, array, origin)`, `_commit()` and `_abort()`. `origin` is the
source path a tensor belongs to (the leaf P for P<sep>array<sep>qvalue), which the sharded
safetensors writer uses to keep every output tensor in the shard of its input.
"""

from __future__ import annotations

import numpy as np

# The parts of a quantized leaf, in the order they are written (Qwix's QArray fields).
QUANTIZED_PARTS = ("qvalue", "scale", "zero_point")


class WriterBase:
    separator = "/"

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

    def write_quantized(self, path: str, parts: dict[str, np.ndarray]) -> None:
        unknown = set(parts) - set(QUANTIZED_PARTS)
        if unknown or not {"qvalue", "scale"} <= set(parts):
            raise ValueError(
                f"{path}: quantized parts are qvalue, scale and optionally zero_point; "
                f"got {sorted(parts)}"
            )
        for name in QUANTIZED_PARTS:
            if name in parts:
                key = self.separator.join((path, "array", name))
                self._add(key, np.asarray(parts[name]), path)

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
