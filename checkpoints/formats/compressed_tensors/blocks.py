"""FP8_BLOCK on weights whose sides are not multiples of the block (128 x 128).

compressed-tensors quantizes such a weight as if it were padded with zeros up to whole blocks
(`maybe_pad_tensor_for_block_quant`), stores the codes at the weight's own shape and one scale
per block, ceil(out/128) x ceil(in/128). A MoE router (Mixtral's `gate`, (experts, hidden)) or a
model of hidden size 576 has such weights. The engine tiles only whole blocks, so the run's plan
(checkpoints/run/plan.py) quantizes each weight the scheme quantizes whose sides do not divide at
its `padded_shape`, reading it through a `PaddedSource` as its zero-padded copy, and the writer
keeps the codes of the weight's own rows and columns (`unpad`). Zeros change no block's absolute
maximum, so the scales are those of the partial blocks, bit for bit what llm-compressor writes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qmill.checkpoints.base import protocols
from qmill.checkpoints.formats.compressed_tensors import schemes as ct_schemes


def block_of(scheme: ct_schemes.Scheme | None) -> tuple[int, int] | None:
    """The (rows, cols) block of a block scheme (FP8_BLOCK); None for any other."""
    tiles = (scheme.rule.get("tiled_axes") or {}) if scheme is not None else {}
    if 0 in tiles and 1 in tiles:
        return int(tiles[0]), int(tiles[1])
    return None


def padded_shape(
    path: str, shape: tuple[int, ...], block: tuple[int, int] | None
) -> tuple[int, ...] | None:
    """The shape a weight is quantized at under `block`: its own sides rounded up to whole
    blocks, for a 2-D `<module>.weight` whose sides a block does not divide; None otherwise."""
    if block is None or len(shape) != 2 or not path.endswith(".weight"):
        return None
    padded = tuple(-(-n // b) * b for n, b in zip(shape, block, strict=True))
    return padded if padded != tuple(shape) else None


class PaddedSource:
    """`source` with the weights of `padded` read as their zero-padded copies."""

    def __init__(self, source: Any, padded: dict[str, protocols.TensorEntry]) -> None:
        self._source = source
        self._padded = padded

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    def entries(self) -> list[protocols.TensorEntry]:
        return [self._padded.get(e.path, e) for e in self._source.entries()]

    def read(self, path: str) -> np.ndarray:
        array = self._source.read(path)
        entry = self._padded.get(path)
        if entry is None:
            return array
        out = np.zeros(entry.shape, array.dtype)
        out[: array.shape[0], : array.shape[1]] = array
        return out

    def __enter__(self) -> PaddedSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self._source.__exit__(*exc)


def unpad(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The codes (or a kept weight) of the weight's own rows and columns."""
    if tuple(np.shape(array)) == tuple(shape):
        return array
    return np.asarray(array)[tuple(slice(0, n) for n in shape)]
