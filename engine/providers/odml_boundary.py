"""The ODML providers' model boundary: inputs and outputs, and the rules as ODML reads them.

LiteRT kernels are integer end to end only when the graph's inputs and output are quantized too.
The output's static range is the statistic ``final_output0`` (``final_output<i>`` for the i-th of
several outputs; ``<method>_output<i>`` for a method other than ``__call__``), at the top of
quant_stats, named as the reference names it; with a fixed input range, the inputs' is
``model_input`` (``model_input_<i>``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from qmill.engine.core import calibration, qarray
from qmill.engine.modeling import interception, provenance
from qmill.engine.modeling import rules as rules_mod

# The statistic of a model's (first) output, as the reference names it ("final" is its name for
# __call__); other methods' outputs are "<method>_output<i>".
MODEL_OUTPUT = "final_output0"
MODEL_INPUT = "model_input"
_BOUNDARY_STAT = re.compile(r"\w+_output\d+|model_input(_\d+)?")


def output_stat_names(method_name: str, count: int) -> list[str]:
    """The statistics of a method's ``count`` output leaves: final_output0, final_output1, ..."""
    prefix = "final" if method_name == "__call__" else method_name
    return [f"{prefix}_output{i}" for i in range(count)]


def is_boundary_stat(name: str) -> bool:
    """Whether a top-level quant_stats entry is a model input's or output's statistic (only a
    LiteRT export uses them; op statistics are ``<op><n>_<lhs|rhs>``)."""
    return _BOUNDARY_STAT.fullmatch(name) is not None


def static_rule(rules_: Sequence[rules_mod.QuantizationRule]) -> rules_mod.QuantizationRule | None:
    """The rule that sets how the model output is quantized: the first static-range one."""
    return next((r for r in rules_ if r.resolved_act_static_scale and r.act_qtype), None)


def output_how(rule: rules_mod.QuantizationRule) -> qarray.HowToQuantize:
    # One calibration per batch (not per example averaged over the batch, as for op inputs): the
    # output is what users read, and a range covering each batch's extremes rarely clips it.
    return qarray.HowToQuantize(
        qtype=rule.act_qtype, calibration_method=rule.resolved_act_calibration_method
    )


def map_outputs(
    rules_: Sequence[rules_mod.QuantizationRule],
    module: Any,
    out: Any,
    fn: Callable[[rules_mod.QuantizationRule, str, Any], Any],
    method_name: str = "__call__",
) -> Any:
    """The model output with each leaf y replaced by fn(rule, name, y): rule the one quantizing
    outputs, name "final_output<i>" for the i-th leaf (output_stat_names). The output as is when
    no rule quantizes it or the model is not a module."""
    rule = static_rule(rules_)
    if rule is None or module is None:
        return out
    leaves, tree = jax.tree.flatten(out)
    names = output_stat_names(method_name, len(leaves))
    return jax.tree.unflatten(tree, [fn(rule, n, y) for n, y in zip(names, leaves, strict=True)])


def map_inputs(rules_, module, inputs, fn) -> Any:
    """The model's (args, kwargs) with each float array leaf y replaced by fn(rule, name, y),
    name "model_input" (or "model_input_<i>" for several), as map_outputs does for outputs."""
    rule = static_rule(rules_)
    leaves, tree = jax.tree.flatten(inputs)
    floats = [i for i, y in enumerate(leaves) if is_float_array(y)]
    if rule is None or module is None or not floats:
        return inputs
    names = [MODEL_INPUT] if len(floats) == 1 else [f"{MODEL_INPUT}_{i}" for i in floats]
    for i, name in zip(floats, names, strict=True):
        leaves[i] = fn(rule, name, leaves[i])
    return jax.tree.unflatten(tree, leaves)


def is_float_array(y: Any) -> bool:
    return isinstance(y, jax.Array) and jnp.issubdtype(y.dtype, jnp.floating)


def fixed_method(value: tuple[float, float] | None, what: str) -> str | None:
    """ "fixed,lo,hi" for a (lo, hi) range, checked as a calibration method."""
    if value is None:
        return None
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a (min, max) pair of numbers, got {value!r}.") from None
    method = f"fixed,{lo!r},{hi!r}"
    calibration.parse(method)  # raises, naming the range, if it is empty or not finite
    return method


def boundary_how(rule, fixed_method: str | None) -> tuple[qarray.HowToQuantize, Any]:
    """How to quantize a model input / output, and the rule to do it with (its calibration
    method replaced by the fixed range, if one is given)."""
    if fixed_method is not None:
        rule = dataclasses.replace(rule, act_calibration_method=fixed_method)
    return output_how(rule), rule


def odml_rules(
    rules: Sequence[rules_mod.QuantizationRule] | None,
) -> list[rules_mod.QuantizationRule] | None:
    """The rules as the ODML providers apply them: activations are static-range by default.

    A rule with act_qtype and act_static_scale left unset (None) gets act_static_scale=True, as
    in the seeds; LiteRT's integer kernels need static scales. An explicit False stays False
    (and is refused where LiteRT needs a static scale).
    """
    if rules is None:
        return None
    return [
        dataclasses.replace(r, act_static_scale=True)
        if isinstance(r, rules_mod.QuantizationRule)
        and r.act_qtype is not None
        and r.act_static_scale is None
        else r
        for r in rules
    ]


@contextlib.contextmanager
def variables_allowed(module: Any) -> Iterator[None]:
    """Lets the output hook create the statistic of a Linen module after its compact method.

    quantize_model calls the hook once the model's method has returned, and Linen only creates
    variables inside setup / compact methods; the module's scope is still bound here, so the
    statistic lands in the module's quant_stats as if the method had created it.
    """
    state = getattr(module, "_state", None) if isinstance(module, nn.Module) else None
    if state is None:
        yield
        return
    before = state.in_compact_method
    state.in_compact_method = True
    try:
        yield
    finally:
        state.in_compact_method = before


def layered_interceptors(provider: Any) -> list[Callable[[], interception.Interceptor]]:
    """The ODML providers' interceptors as the reference stacks them: a structural layer (the
    view handlers that follow weights through reshapes and casts), then the numerical one (the
    ops and everything else). quantize_model runs the two as one map, as it did before."""
    handlers = provider.get_intercept_map()
    structural = {k: h for k, h in handlers.items() if provenance.is_view_target(k)}
    numerical = {k: h for k, h in handlers.items() if k not in structural}
    return [
        lambda: interception.Interceptor(mapping=structural, id=(id(provider), 0)),
        lambda: interception.Interceptor(mapping=numerical, id=(id(provider), 1)),
    ]
