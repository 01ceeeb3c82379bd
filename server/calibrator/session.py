"""One calibration on the engine executor: the model under the QT provider, batch after batch.

Statistics are additive (engine/averaging.py: int32 counts and float32 sums). A continued
calibration starts from the stored stats and keeps adding to them, batch by batch, so the sums
are the same additions in the same order as one call over all the batches: the merge is exact,
bit for bit. Everything here is blocking JAX work, called only from the server's executor.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import qmill.engine as qe
from qmill.engine.core import qarray
from qmill.engine.modelfree import layout, leaf
from qmill.engine.modeling import flax_util
from qmill.engine.modeling import rules as rules_lib
from qmill.engine.programs import program as programs
from qmill.engine.programs import zoo
from qmill.engine.providers import odml_names
from qmill.server import errors
from qmill.server import params as params_lib
from qmill.server.calibrator import store

_LITERT_QTYPES = (None, "int8")


def check_rules(rules: Sequence[rules_lib.QuantizationRule]) -> None:
    """Raises ValueError unless `rules` give something to calibrate (static-range activations)."""
    if not rules:
        raise ValueError(
            "Calibrate needs rules, e.g. weight_qtype int8, act_qtype int8, act_static_scale"
        )
    if not any(r.act_qtype and r.resolved_act_static_scale for r in rules):
        raise ValueError(
            "no rule has static-range activations (act_qtype with act_static_scale): nothing "
            "to calibrate"
        )


def model_key(name: str, config: Any) -> str:
    return json.dumps([name, dataclasses.asdict(config)], sort_keys=True, default=list)


def _litert_rules(rules: Sequence[rules_lib.QuantizationRule]) -> bool:
    """Rules LiteRT can store: calibrate with OdmlQatProvider so the output gets a statistic."""
    return all(
        r.tile_size is None
        and r.weight_qtype in _LITERT_QTYPES
        and r.act_qtype in _LITERT_QTYPES
        and (r.act_qtype is None or r.resolved_act_static_scale)
        for r in rules
    )


def _shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """{path: (shape, dtype)} of arrays or abstract (ShapeDtypeStruct) leaves."""
    flat = params_lib.flatten(flax_util.unbox(tree))
    return {k: (tuple(v.shape), str(np.dtype(v.dtype))) for k, v in flat.items()}


# The jitted step per (model, config, rules): a new closure per call compiled again every call
# (2.5 s for 32 batches of the built-in cnn, 12.6 batches/s); the last few are kept.
_STEPS: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
_STEPS_LOCK = threading.Lock()
_STEPS_SIZE = 8


def _cached_step(key: tuple[str, str], model: Any) -> Any:
    with _STEPS_LOCK:
        if key in _STEPS:
            _STEPS.move_to_end(key)
            return _STEPS[key]

    @jax.jit
    def step(params: Any, stats: Any, x: jax.Array) -> Any:
        _, upd = model.apply({"params": params, "quant_stats": stats}, x, mutable=["quant_stats"])
        return flax_util.unbox(upd["quant_stats"])

    with _STEPS_LOCK:
        _STEPS[key] = step
        while len(_STEPS) > _STEPS_SIZE:
            _STEPS.popitem(last=False)
    return step


class Session:
    """The model, its params and the running stats of one Calibrate call."""

    def __init__(
        self,
        entry: zoo.ModelEntry,
        config: Any,
        params: Any,
        rules: Sequence[rules_lib.QuantizationRule],
        previous: store.Calibration | None,
    ) -> None:
        self.module = entry.build(config)
        self.rules = list(rules)
        self.input = entry.example_input(config, 1)
        provider = (
            qe.OdmlQatProvider(self.rules) if _litert_rules(self.rules) else qe.QtProvider(rules)
        )
        self.model = qe.quantize_model(self.module, provider)
        abstract = jax.eval_shape(self.model.init, jax.random.key(0), self.input)
        # An ODML calibration names statistics as the reference does (jnp.dot "dot<n>", one
        # statistic for sibling ops); the trace above told which PTQ op each one serves.
        self._ptq_aliases = dict(getattr(provider, "stat_aliases", {}))
        self.stat_aliases = odml_names.aliases_by_stat(self._ptq_aliases)
        params = params_lib.unwrap(params)
        expected, got = _shapes(abstract["params"]), _shapes(params)
        if expected != got:
            raise errors.FailedPrecondition(_mismatch(expected, got))
        self.params = jax.tree.map(jnp.asarray, params)
        if previous is not None:
            if _shapes(previous.stats) != _shapes(abstract["quant_stats"]):
                raise errors.FailedPrecondition(
                    f"calibration {previous.id} holds stats of another model or rules"
                )
            self.stats = jax.tree.map(jnp.asarray, previous.stats)
        else:
            # The init values of statistics are zeros (averaging.init): no need to run init.
            self.stats = jax.tree.map(
                lambda s: jnp.zeros(s.shape, s.dtype), flax_util.unbox(abstract["quant_stats"])
            )
        # For QuantizeParams' static ranges by calibration id: each statistic's act qtype.
        self.stat_qtypes = programs.stat_qtypes(self.stats, self.rules)
        self.batches = previous.batches if previous else 0
        self.examples = previous.examples if previous else 0
        key = (model_key(entry.name, config), repr(self.rules))
        self._step = _cached_step(key, self.model)

    def check_batch(self, array: np.ndarray) -> np.ndarray:
        """The batch as the model takes it; ValueError saying what to send instead."""
        want_shape, want = tuple(self.input.shape[1:]), np.dtype(self.input.dtype)
        if array.ndim != len(want_shape) + 1 or tuple(array.shape[1:]) != want_shape:
            raise ValueError(
                f"batch of shape {list(array.shape)}; this model takes [batch, "
                f"{', '.join(map(str, want_shape))}] {want.name}"
            )
        if array.dtype != want:
            # Same kind (float64 -> float32, int64 -> int32) is a safe cast for inputs.
            if array.dtype.kind != want.kind and not (
                want.kind == "f" and array.dtype.kind in "fV"
            ):
                raise ValueError(f"batch of dtype {array.dtype}; this model takes {want.name}")
            array = array.astype(want)
        if array.shape[0] == 0:
            raise ValueError("empty batch: send at least one example")
        # Stats are sums kept across calls: one NaN would spoil the calibration id for good, or
        # vanish in a max reduction that drops it (XLA:CPU does for some shapes).
        bad = np.flatnonzero(~np.isfinite(array).reshape(len(array), -1).all(axis=1))
        if bad.size:
            raise ValueError(
                f"batch has NaN or Inf values in {len(bad)} example(s) (first: example "
                f"{int(bad[0])}); clean or drop them"
            )
        return array

    def add_batch(self, array: np.ndarray) -> None:
        x = self.check_batch(array)
        self.stats = self._step(self.params, self.stats, jnp.asarray(x))
        self.batches += 1
        self.examples += int(x.shape[0])

    def host_stats(self) -> dict[str, Any]:
        return jax.tree.map(np.asarray, self.stats)

    def ptq_params(self) -> dict[str, Any]:
        """{path: QArray or array}: the static-range PTQ params made with the merged stats."""
        ptq = qe.quantize_model(self.module, qe.PtqProvider(self.rules))
        abstract = jax.eval_shape(ptq.init, jax.random.key(0), self.input)
        op_stats = odml_names.ptq_stats(self.stats, self._ptq_aliases)
        tree = qe.quantize_params(self.params, abstract["params"], op_stats)
        return params_lib.flatten(tree)

    def float_params(self) -> dict[str, Any]:
        return params_lib.flatten(self.params)


def _mismatch(expected: dict, got: dict) -> str:
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    shapes = [
        f"{k}: {got[k]} vs model {expected[k]}"
        for k in expected
        if k in got and got[k] != expected[k]
    ]
    parts = [
        f"missing {missing[:5]}" if missing else "",
        f"unexpected {extra[:5]}" if extra else "",
    ]
    parts.append(f"mismatched {shapes[:5]}" if shapes else "")
    return "params do not fit the model: " + "; ".join(p for p in parts if p)


def param_results(
    params: dict[str, Any], floats: dict[str, Any]
) -> Iterator[tuple[layout.LeafPlan | None, str, leaf.LeafResult | np.ndarray]]:
    """(plan, path, result) per PTQ param: a LeafResult for quantized ones, else the array.

    ``floats`` are the float params, for the quality record of each quantized one.
    """
    for path, value in params.items():
        value = flax_util.unbox(value)
        how = getattr(value, "how", None)
        inner = flax_util.unbox(getattr(value, "array", value))
        if isinstance(inner, qarray.QArray):
            plan = layout.LeafPlan(
                path=path,
                qtype=inner.qtype,
                channelwise_axes=tuple(how.channelwise_axes) if how else (),
                tiled_axes=tuple(how.tiled_axes) if how else (),
                calibration_method=how.calibration_method if how else "absmax",
            )
            deq = np.asarray(qarray.dequantize(inner), np.float32)
            x = np.asarray(floats[path], np.float32).reshape(deq.shape)
            yield (
                plan,
                path,
                leaf.LeafResult(
                    qvalue=np.asarray(inner.qvalue),
                    scale=np.asarray(inner.scale),
                    zero_point=None if inner.zero_point is None else np.asarray(inner.zero_point),
                    quality=leaf.measure(x, deq),
                ),
            )
        elif how is not None:
            # A static activation scale (WithAux around a float array): its PTQ param path is
            # P/array, as the pure dict of an NNX model and qmill's key layout have it.
            yield None, f"{path}/array", np.asarray(inner)
        else:
            yield None, path, np.asarray(inner)
