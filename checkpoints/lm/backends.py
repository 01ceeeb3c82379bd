"""The backends a language model's calibration hands the checkpoint pipeline: the embedded engine
wrapped so that the calibrated linears' results (Precomputed) or the Linears' input scales
(WithInputScales) come back with the rest, and the pipeline writes the output as usual."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from qmill.checkpoints.lm import work as lm_work
from qmill.checkpoints.run import outcome


class Wrapper:
    """A backend in front of `inner` (entered and left with it; its `target` said as its own)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.target = getattr(inner, "target", "embedded")

    def __enter__(self) -> Wrapper:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._inner.__exit__(*exc)


class Precomputed(Wrapper):
    """A backend that hands back the calibrated linears' results and quantizes every other
    tensor with the embedded engine, so the checkpoint pipeline writes the output as usual."""

    def __init__(self, inner: Any, result: Any) -> None:
        """`result`: calibration.calibrate's LmOutcome."""
        super().__init__(inner)
        self._results = dict(lm_work.results_of(result.directory))

    def quantize(
        self, recipe: dict[str, Any], tensors: Any, **kwargs: Any
    ) -> Iterator[outcome.TensorOutcome]:
        return self._inner.quantize(recipe, tensors, precomputed=self._results, **kwargs)


class WithInputScales(Wrapper):
    """A backend whose quantized results carry their Linear's input scale part
    (ct_activations.input_parts)."""

    def __init__(self, inner: Any, parts: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        super().__init__(inner)
        self._parts = parts

    def quantize(
        self, recipe: dict[str, Any], tensors: Any, **kwargs: Any
    ) -> Iterator[outcome.TensorOutcome]:
        for result in self._inner.quantize(recipe, tensors, **kwargs):
            extra = self._parts.get(result.path) if result.quantized else None
            yield dataclasses.replace(result, parts={**result.parts, **extra}) if extra else result
