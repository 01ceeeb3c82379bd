"""Building programs on the client: a Linen or NNX model + rules + example inputs -> artifact.

The other half of engine/programs.py (which the server uses to load, check and run them); see
its docstring for the two kinds and the artifact layout. This runs the user's model code, so
only the client (where that code already is) calls it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

from qmill.engine.contrib import awq, gptq, smooth_quant
from qmill.engine.modeling import flax_util
from qmill.engine.modeling import rules as rules_lib
from qmill.engine.programs.program import (
    CALIBRATE,
    CALIBRATE_PLATFORMS,
    EXPORT,
    flat_paths,
    serialize,
    stat_qtypes,
)
from qmill.engine.providers import model as model_lib
from qmill.engine.providers import odml, odml_conversion, odml_names, qt


def _abstract(inputs: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
    # Batch sizes are fixed: the engine's tiling decides shapes in Python (tile < axis size),
    # which a symbolic batch dimension cannot answer.
    return [jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype) for x in inputs]


METHODS = ("static", "gptq", "awq", "smoothquant")


def _method_provider(rules: Sequence[rules_lib.QuantizationRule], method: str) -> Any:
    """The calibration provider of a calibrated method, its rules made of the given ones (every
    QuantizationRule field kept)."""
    rule_type, provider = {
        "gptq": (gptq.GptqRule, gptq.GptqCalibrationProvider),
        "awq": (awq.AwqRule, awq.AwqCalibrationProvider),
        "smoothquant": (smooth_quant.SqRule, smooth_quant.SqCalibrationProvider),
    }[method]
    fields = [f.name for f in dataclasses.fields(rules_lib.QuantizationRule)]
    return provider([rule_type(**{f: getattr(r, f) for f in fields}) for r in rules])


def _calibration_provider(
    rules: Sequence[rules_lib.QuantizationRule], method: str = "static"
) -> Any:
    if method not in METHODS:
        raise ValueError(f"unknown calibration method {method!r}; one of {', '.join(METHODS)}")
    if method != "static":
        return _method_provider(rules, method)
    litert = all(
        r.tile_size is None
        and r.weight_qtype in (None, "int8")
        and r.act_qtype in (None, "int8")
        and (r.act_qtype is None or r.resolved_act_static_scale)
        for r in rules
    )
    return odml.OdmlQatProvider(rules) if litert else qt.QtProvider(rules)


def calibration_program(
    model: nn.Module | nnx.Module,
    rules: Sequence[rules_lib.QuantizationRule],
    *example_inputs: Any,
    params: Any = None,
    platforms: Sequence[str] = CALIBRATE_PLATFORMS,
    method: str = "static",
) -> tuple[bytes, dict[str, np.ndarray]]:
    """A calibrate artifact for ``model`` under ``rules``, and the model's float params.

    Args:
      model: an unbound Linen module, or an NNX module (its own params are the float params).
      rules: with at least one static-range activation rule (act_qtype, act_static_scale).
      *example_inputs: one example batch per model input; the program takes batches of exactly
        these shapes (the server refuses others, saying which).
      params: Linen only: the float params (pure dict); None initialises them with key 0.
      platforms: jax platforms the artifact is lowered for; the server runs its own.
      method: "static" (static activation ranges), or a calibrated weight method ("gptq",
        "awq", "smoothquant") whose statistics the program collects for every weight the rules
        match (`<weight>_gptq`...); QuantizeParams applies it by calibration id.

    Returns:
      (artifact bytes, {path: float param} to upload for Calibrate).
    """
    if not example_inputs:
        raise ValueError("give one example batch per model input")
    provider = _calibration_provider(rules, method)
    specs = _abstract(example_inputs)
    if isinstance(model, nnx.Module):
        fn, params_tree, stats_tree = _nnx_calibrate(model, provider, example_inputs)
    else:
        fn, params_tree, stats_tree = _linen_calibrate(model, provider, example_inputs, params)
    params_tree = jax.tree.map(np.asarray, params_tree)
    if not flat_paths(stats_tree):
        if method != "static":
            raise ValueError(f"the rules match no weight op of the model: nothing for {method}")
        raise ValueError("the rules collect no statistics: add act_qtype with act_static_scale")
    exported = jax.export.export(jax.jit(fn), platforms=tuple(platforms))(
        _avals(params_tree), _avals(stats_tree), *specs
    )
    # An ODML calibration names statistics as the reference (jnp.dot "dot<n>", one statistic for
    # sibling ops): the header says which PTQ ops each one's static scale is for.
    aliases = odml_names.aliases_by_stat(getattr(provider, "stat_aliases", {}))
    data = serialize(CALIBRATE, exported, stat_qtypes(stats_tree, rules), aliases)
    return data, flat_paths(params_tree)


def _avals(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _linen_calibrate(module: nn.Module, provider: Any, inputs: Sequence[Any], params: Any):
    qmodel = model_lib.quantize_model(module, provider)
    abstract = jax.eval_shape(qmodel.init, jax.random.key(0), *inputs)
    if params is None:
        params = flax_util.unbox(module.init(jax.random.key(0), *inputs)["params"])
    params = flax_util.unbox(params)

    def fn(p: Any, stats: Any, *xs: Any) -> Any:
        _, upd = qmodel.apply({"params": p, "quant_stats": stats}, *xs, mutable=["quant_stats"])
        return flax_util.unbox(upd["quant_stats"])

    return fn, params, flax_util.unbox(abstract.get("quant_stats", {}))


def _nnx_calibrate(model: nnx.Module, provider: Any, inputs: Sequence[Any]):
    qmodel = model_lib.quantize_model(model, provider, *inputs)
    graphdef, params_state, stats_state, rest = nnx.split(
        qmodel, nnx.Param, flax_util.QuantStat, ...
    )

    # A QuantStat's value is a dict, which replace_by_pure_dict does not descend into: rebuild
    # the states from leaves instead (a pure dict and its state flatten in the same key order).
    params_def, stats_def = jax.tree.structure(params_state), jax.tree.structure(stats_state)

    def fn(p: Any, stats: Any, *xs: Any) -> Any:
        ps = jax.tree.unflatten(params_def, jax.tree.leaves(p))
        ss = jax.tree.unflatten(stats_def, jax.tree.leaves(stats))
        m = nnx.merge(graphdef, ps, ss, rest)
        m(*xs)
        return nnx.to_pure_dict(nnx.state(m, flax_util.QuantStat))

    return fn, nnx.to_pure_dict(params_state), nnx.to_pure_dict(stats_state)


def export_program(
    model: nn.Module | nnx.Module,
    rules: Sequence[rules_lib.QuantizationRule],
    *example_inputs: Any,
    params: Any = None,
    quant_stats: Any = None,
) -> bytes:
    """An export artifact: ``model`` as LiteRT will run it, for the server's LiteRT converter.

    Args:
      model: an unbound Linen module or an NNX module.
      rules: weight-only rules, or static-range rules with ``quant_stats``.
      *example_inputs: one example per model input; their shapes (batch included) are the
        exported model's.
      params: the float params (pure dict); for NNX None takes the model's own.
      quant_stats: merged statistics of a calibration with the same rules (pure dict, as
        Calibrate returns them unflattened); None for weight-only rules.
    """
    if not example_inputs:
        raise ValueError("give one example batch per model input")
    specs = _abstract(example_inputs)
    if isinstance(model, nnx.Module):
        if params is None:
            params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        provider = odml_conversion.OdmlConversionProvider(rules, params, quant_stats)
        qmodel = model_lib.quantize_model(model, provider, *example_inputs)

        def fn(*xs: Any) -> Any:
            return qmodel(*xs)

    else:
        if params is None:
            raise ValueError("a Linen model needs its float params")
        params = flax_util.unbox(params)
        provider = odml_conversion.OdmlConversionProvider(rules, params, quant_stats)
        qmodel = model_lib.quantize_model(model, provider)
        constants = jax.tree.map(np.asarray, params)

        def fn(*xs: Any) -> Any:
            return qmodel.apply({"params": constants}, *xs)

    exported = jax.export.export(jax.jit(fn), platforms=("cpu",))(*specs)
    return serialize(EXPORT, exported, {})
