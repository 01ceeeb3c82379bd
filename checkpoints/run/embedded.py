"""The engine in-process: the same calls and outcomes as a server, without one.

The CLI's default backend and the server's batch jobs both quantize through it. JAX and the
engine are imported when the first EmbeddedClient is made, so `import qmill.checkpoints` stays
light.
"""

from __future__ import annotations

import gc
import importlib
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent import futures
from typing import Any

import numpy as np

from qmill.checkpoints.base import dtypes, errors
from qmill.checkpoints.run import compilation_cache, outcome

# What quantizing runs: the engine's model-free room (and with it jax).
_ENGINE = (
    "qmill.engine.modelfree.recipes",
    "qmill.engine.modelfree.layout",
    "qmill.engine.modelfree.leaf",
)


def load_engine(*, freeze: bool = False) -> None:
    """Imports the engine (jax included) and turns the compilation cache on, once a process.

    `freeze`, for a process that quantizes once and exits (the CLI): the cyclic garbage
    collector is paused while jax is imported and everything made so far is then frozen
    (gc.freeze): some 100k objects, hardly any garbage, that no later collection walks again,
    ~0.08 s CPU of a run. A server, which lives on, leaves its collector alone."""
    if all(name in sys.modules for name in _ENGINE):
        compilation_cache.enable()
        return
    pause = freeze and gc.isenabled()
    if pause:
        gc.disable()
    try:
        compilation_cache.enable()  # before the engine's first compilation in this process
        for name in _ENGINE:
            importlib.import_module(name)
    finally:
        if pause:
            gc.freeze()
            gc.enable()


class EmbeddedClient:
    """Quantizes in this process with the same engine code the server runs.

    One tensor ahead: while the caller handles a tensor's outcome (the pipeline records and
    writes it, which is file I/O), a worker thread reads and quantizes the next one, as a
    server does. Outcomes come in the order of `tensors`, and an error (the caller's own,
    raised while reading) is raised where that tensor's outcome would have been.
    """

    target = "embedded"

    def __init__(self) -> None:
        load_engine()

    def __enter__(self) -> EmbeddedClient:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def close(self) -> None:
        return None

    def quantize(
        self,
        recipe: dict[str, Any],
        tensors: Iterable[tuple[str, np.ndarray]],
        *,
        calibration_stats: dict[str, np.ndarray] | None = None,
        precomputed: Mapping[str, Callable[[], Any]] | None = None,
        **_: Any,
    ) -> Iterator[outcome.TensorOutcome]:
        """As a server's QuantizeParams; `calibration_stats` (a calibrated method's flat
        statistics, as `qmill calibrate --stats-output` writes them) quantize the weights they
        name by that method, as a server does for a calibration id. `precomputed`: tensor name
        → a loader of its GPTQ'd LeafResult (a language model calibrated layer by layer,
        lm_calibration.py), handed back as it is."""
        from qmill.engine.modelfree import leaf, recipes  # lazy: imported by load_engine

        quantize = leaf.quantize_leaf
        if calibration_stats:
            # Only then: engine.contrib imports the providers (flax.nnx, optax: ~0.3 s).
            from qmill.engine.contrib import leaf as contrib_leaf

            quantize = contrib_leaf.quantizer(contrib_leaf.method_stats(calibration_stats))
        if precomputed:
            quantize = _precomputed(precomputed, quantize)

        # A run's plan (checkpoints/run/plan.py) hands each tensor's LeafPlan in the recipe it
        # sends: nothing to read again. Any other recipe is read here, once.
        leaves = getattr(recipe, "leaves", None)
        if leaves is not None:
            plan_of = _given(leaves)
        else:
            try:
                plan_of = _planner(recipes.recipe_from_mapping(recipe))
            except ValueError as e:
                raise errors.QmillError("INVALID_ARGUMENT", str(e)) from None
        source = iter(tensors)

        def next_outcome() -> outcome.TensorOutcome | None:
            item = next(source, None)
            if item is None:
                return None
            return _quantize_one(*item, plan_of, quantize)

        with futures.ThreadPoolExecutor(1, thread_name_prefix="qmill-embedded") as worker:
            pending = worker.submit(next_outcome)
            while (done := pending.result()) is not None:
                pending = worker.submit(next_outcome)
                yield done


def _precomputed(loaders: Mapping[str, Callable[[], Any]], quantize: Any) -> Any:
    def quantize_or_load(array: np.ndarray, plan: Any) -> Any:
        load = loaders.get(plan.path)
        return quantize(array, plan) if load is None else load()

    return quantize_or_load


def _given(leaves: Mapping[str, Any]) -> Callable[[str, np.ndarray], Any]:
    """The plan's LeafPlan of a tensor (checkpoints/run/plan.py)."""

    def plan(path: str, _: np.ndarray) -> Any:
        return leaves[path]

    return plan


def _planner(engine_recipe: Any) -> Callable[[str, np.ndarray], Any]:
    """The engine's plan of a tensor under `engine_recipe` (for a recipe without its plan)."""
    from qmill.engine.modelfree import layout  # lazy: imported by load_engine

    def plan(path: str, array: np.ndarray) -> Any:
        return layout.plan_leaf(path, array.shape, array.dtype, engine_recipe)

    return plan


def _quantize_one(
    path: str,
    array: np.ndarray,
    plan_of: Callable[[str, np.ndarray], Any],
    quantize: Any,
) -> outcome.TensorOutcome:
    nbytes = dtypes.packed_nbytes(array.dtype, array.shape)
    try:
        plan = plan_of(path, array)
        if not plan.quantize:
            return outcome.TensorOutcome(
                path=path, quantized=False, parts={}, reason=plan.reason, input_bytes=nbytes
            )
        result = quantize(array, plan)
    except (ValueError, TypeError) as e:
        raise errors.QmillError("INVALID_ARGUMENT", str(e)) from None
    qvalue = result.qvalue
    if result.packed_as is not None:  # 4-bit codes, packed by the engine as stored
        qvalue = dtypes.Packed4(qvalue, *result.packed_as)
    parts = {"qvalue": qvalue, "scale": result.scale}
    if result.zero_point is not None:
        parts["zero_point"] = result.zero_point
    parts.update(result.beside)  # AWQ's awq_scale, SmoothQuant's inv_sq_scale (P/<name>)
    return outcome.TensorOutcome(
        path=path,
        quantized=True,
        parts=parts,
        how={
            "qtype": plan.qtype,
            "channelwise_axes": plan.channelwise_axes,
            "tiled_axes": dict(plan.tiled_axes),
            "calibration_method": plan.calibration_method,
        },
        sqnr_db=result.quality.sqnr_db,
        mean_relative_error=result.quality.mean_relative_error,
        input_bytes=nbytes,
        output_sqnr_db=result.quality.output_sqnr_db,
        rtn_output_sqnr_db=result.quality.rtn_output_sqnr_db,
    )
