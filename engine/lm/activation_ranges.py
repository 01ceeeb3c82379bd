"""Each linear's input range over the calibration tokens: what a static activation scale is
calibrated from.

Lingo:
  range    (min, max) of a linear's input over every element of every token of every chunk,
           float32, as Python floats. llm-compressor's `static_minmax` observer (the one its
           FP8 and NVFP4 presets name for inputs) keeps exactly this: the running min and max of
           everything it saw, so ranges merge by min and max, in any order, any number of times.
  stage    forward.Stage: the linears that share one input (q/k/v; o; gate/up; down).

A range is taken where sequential.calibrate_layer hands each stage's input to its observer,
before the stage's linears are quantized; `layer_ranges` runs a layer in float for that alone
(round-to-nearest weights: llm-compressor's QuantizationModifier propagates the float model).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from qmill.engine.contrib import gptq_core
from qmill.engine.lm import config as config_lib
from qmill.engine.lm import sequential

Range = tuple[float, float]


@jax.jit
def _min_max(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    return jnp.stack([jnp.min(x), jnp.max(x)])


def input_range(inputs: Sequence[jax.Array]) -> Range:
    """(min, max) over every element of every chunk of a stage's input."""
    if not inputs:
        raise ValueError("a range needs at least one chunk of inputs")
    both = jnp.stack([_min_max(x) for x in inputs])
    return float(jnp.min(both[:, 0])), float(jnp.max(both[:, 1]))


def merge(ranges: Mapping[str, Range], names: Sequence[str], seen: Range) -> dict[str, Range]:
    """`ranges` with `seen` folded into the range of each of `names` (min of mins, max of
    maxes); idempotent, so a layer observed twice (a resumed run) gives the same ranges."""
    out = dict(ranges)
    for name in names:
        low, high = out.get(name, seen)
        out[name] = (min(low, seen[0]), max(high, seen[1]))
    return out


# calibrate_layer's GPTQ options, unused when no linear is planned.
_NO_GPTQ = gptq_core.GptqOptions()


def layer_ranges(
    cfg: config_lib.LmConfig,
    layer: int,
    weights: Mapping[str, jax.Array],
    hidden: sequential.Hidden,
    *,
    all_experts: bool = False,
) -> tuple[dict[str, Range], sequential.Hidden]:
    """Decoder layer `layer` in float on every chunk of `hidden`: each of its linears' input
    range (full names), and the layer's output (the next layer's input). A mixture of experts'
    expert is observed on the tokens routed to it (one that gets none has no range), or with
    `all_experts` on every token (llm-compressor's calibrate-all-experts); the output keeps the
    routed result either way."""
    found: dict[str, Range] = {}

    def observe(names: tuple[str, ...], inputs: Sequence[jax.Array]) -> None:
        found.update(merge(found, names, input_range(inputs)))

    done = sequential.calibrate_layer(
        cfg, layer, weights, hidden, {}, _NO_GPTQ, observe, all_experts=all_experts
    )
    return found, done.hidden
