"""A source with some tensors read from loaders instead: the norms and biases a language model's
AWQ / SmoothQuant folded its scales into (checkpoints/lm/calibration.py), written in place of the
source's by the pipeline (`replaced`)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from qmill.checkpoints.base import protocols


class ReplacedSource:
    """`source` with some tensors read from loaders instead (same dtype and shape)."""

    def __init__(
        self, source: protocols.TensorSource, loaders: Mapping[str, Callable[[], np.ndarray]]
    ) -> None:
        self._source = source
        self._loaders = dict(loaders)
        self._entries = {e.path: e for e in source.entries()}
        unknown = sorted(set(self._loaders) - set(self._entries))
        if unknown:
            raise ValueError(f"replaced tensors not in the source: {', '.join(unknown[:3])}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    def entries(self) -> list[protocols.TensorEntry]:
        return self._source.entries()

    def read(self, path: str) -> np.ndarray:
        load = self._loaders.get(path)
        if load is None:
            return self._source.read(path)
        array, entry = np.asarray(load()), self._entries[path]
        if array.dtype != entry.dtype or tuple(array.shape) != entry.shape:
            raise ValueError(
                f"{path}: its replacement is {array.dtype}{list(array.shape)}, the source's "
                f"{entry.dtype}{list(entry.shape)}"
            )
        return array

    def digest(self) -> str:
        """sha256 of the replaced tensors' names and bytes."""
        h = hashlib.sha256()
        for path in sorted(self._loaders):
            h.update(path.encode() + b"\0" + np.ascontiguousarray(self.read(path)).tobytes())
        return h.hexdigest()

    def __enter__(self) -> ReplacedSource:
        return self

    def __exit__(self, *exc: object) -> None:
        return None
