"""A causal language model calibrated layer by layer: GPTQ in the sequential scheme, and the
perplexity of the float and the quantized model computed the same way.

Lingo:
  hidden   the residual stream entering a decoder layer, (samples, tokens, hidden) float32, held
           as a tuple of chunks of samples so that no step holds every sample's intermediates.
  stage    forward.Stage: the part of a decoder layer that produces the common input of a group
           of linears (q/k/v; o; gate/up; down), given the linears of the earlier stages.

The scheme (the GPTQ paper's "true sequential", as llm-compressor's sequential pipeline runs
it, but one pass per layer): for each stage in order, run it on every chunk with the layer's
earlier linears already quantized, accumulate the Hessian H = Σ xᵀx of its input, GPTQ each of
its linears with H, and go on with them quantized. The layer's output is thus the quantized
layer's, and is the next layer's input. Only one layer's weights, the hidden states and one
stage's Hessian are held at a time.

With QEP (qep.py) a second stream runs beside it, the float model's hidden states through the
float weights, and each linear is corrected for its input's error before GPTQ.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.contrib import gptq_core
from qmill.engine.contrib import leaf as contrib_leaf
from qmill.engine.lm import config as config_lib
from qmill.engine.lm import forward, hessian, moe_calibration
from qmill.engine.lm import qep as qep_lib
from qmill.engine.modelfree import layout
from qmill.engine.modelfree import leaf as leaf_lib

Hidden = tuple[jax.Array, ...]
# Called with each stage's linears (full names) and their common input, chunk by chunk, before
# they are quantized (activation_ranges.py collects static activation ranges this way).
Observer = Callable[[tuple[str, ...], Sequence[jax.Array]], None]


@dataclasses.dataclass(frozen=True)
class LayerCalibration:
    """What calibrating one decoder layer gave."""

    # Full tensor name → its quantized parts, as every writer takes them.
    results: dict[str, leaf_lib.LeafResult]
    # Full tensor name → GPTQ's loss: Σ (w − ŵ)² / (2 Hinv_ii²), the output error it estimates.
    losses: dict[str, float]
    # The layer's weights as the quantized model has them (relative names, float32).
    weights: dict[str, jax.Array]
    # The quantized layer's output: the next layer's input.
    hidden: Hidden
    # Full tensor name → why it was quantized round to nearest instead (a mixture of experts'
    # expert that no calibration token reached).
    rtn: dict[str, str] = dataclasses.field(default_factory=dict)
    # Float tensors besides the quantized linears that the calibration changed (full names, their
    # own dtype): the norms and biases AWQ / SmoothQuant fold their scales into (smoothing.py).
    folded: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # Full tensor name → its method where not GPTQ alone ("awq", "smoothquant+gptq", "rtn", ...).
    methods: dict[str, str] = dataclasses.field(default_factory=dict)
    # One entry per fold applied (smoothing.py): its scale's ratio and output errors, or strength.
    smoothing: list[dict] = dataclasses.field(default_factory=list)
    # QEP: the float model's output of the layer (the next layer's float stream), else None.
    reference: Hidden | None = None


def split(samples: np.ndarray | jax.Array, chunk: int) -> tuple[jax.Array, ...]:
    """`samples` (N, ...) as chunks of at most `chunk` samples along the first axis."""
    if chunk <= 0:
        raise ValueError(f"the chunk size must be positive, got {chunk}")
    return tuple(jnp.asarray(samples[i : i + chunk]) for i in range(0, len(samples), chunk))


def _stage(cfg, layer, index, weights, carry):
    return forward.stage_fn(cfg, layer, index)(weights, carry)


def _as_float(weights: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    return {name: jnp.asarray(w) for name, w in weights.items()}


def calibrate_layer(
    cfg: config_lib.LmConfig,
    layer: int,
    weights: Mapping[str, np.ndarray | jax.Array],
    hidden: Hidden,
    plans: Mapping[str, layout.LeafPlan],
    options: gptq_core.GptqOptions,
    observe: Observer | None = None,
    *,
    all_experts: bool = False,
    qep: qep_lib.QepOptions | None = None,
    reference: Hidden | None = None,
) -> LayerCalibration:
    """GPTQs the linears of decoder layer `layer` that `plans` quantizes, in the sequential
    scheme (module docstring), on the hidden states entering it.

    Args:
      weights: the layer's tensors as read (names relative to its prefix).
      hidden: the chunks of hidden states entering the layer (not kept: a caller that drops
        its own reference lets each be freed as the layer goes).
      plans: relative name → LeafPlan (the recipe's), for every linear to quantize; linears not
        in it stay in float.
      options: GPTQ's.
      observe: given, sees each stage's input (Observer).
      all_experts: a mixture of experts' experts take the statistics of every token, not only
        of those routed to them (moe_calibration.py).
      qep: given, each linear is corrected as QEP does (qep.py) before GPTQ, on `reference`:
        the float model's hidden states entering the layer, chunked as `hidden`.

    Raises:
      ValueError: a plan GPTQ cannot follow (no single contracted axis, a group size that does
        not divide the input features); QEP without its float stream, or on a layer of
        experts.
    """
    prefix = config_lib.layer_prefix(cfg, layer)
    _check_qep(cfg, layer, qep, reference)
    source = _as_float(weights)
    current = dict(source)
    carries = [{"h": h} for h in hidden]
    floats = None if reference is None else [{"h": h} for h in reference]
    # The carries hold the chunks now: with the caller's references given up too (lm
    # checkpoints' Streams.take_hidden), each is freed once the first stage has replaced it.
    del hidden, reference
    results: dict[str, leaf_lib.LeafResult] = {}
    losses: dict[str, float] = {}
    rtn: dict[str, str] = {}
    for index, stage in enumerate(forward.stages(cfg, layer)):
        if stage.name == "experts":  # a mixture of experts' block: the rest of the layer
            block = _experts(cfg, prefix, current, carries, plans, options, observe, all_experts)
            results |= {prefix + n: r for n, r in block.results.items()}
            losses |= {prefix + n: v for n, v in block.losses.items()}
            rtn = {prefix + n: why for n, why in block.rtn.items()}
            carries = [{"h": h} for h in block.hidden]
            break
        targets = [name for name in stage.linears if name in plans]
        h, h_delta = _run_stage(cfg, layer, index, (current, carries), (source, floats), targets)
        if observe is not None and stage.linears:
            observe(tuple(prefix + n for n in stage.linears), [c["x"] for c in carries])
        if not targets:
            continue
        arrays = [current[n] for n in targets]
        if qep is not None:
            arrays = qep_lib.correct(arrays, h, h_delta, qep)
        done = contrib_leaf.gptq_static_leaves(arrays, [plans[n] for n in targets], h, options)
        for name, (result, deq, loss) in zip(targets, done, strict=True):
            results[prefix + name] = result
            losses[prefix + name] = loss
            current[name] = deq
        del h, h_delta, arrays
    outputs = tuple(c["h"] for c in carries)
    qep_parts = {} if floats is None else {
        "methods": {prefix + n: "qep" for n in plans}, "reference": tuple(c["h"] for c in floats)
    }  # fmt: skip
    return LayerCalibration(results, losses, current, outputs, rtn, **qep_parts)


def _check_qep(cfg, layer, qep, reference) -> None:
    if (qep is None) != (reference is None):
        raise ValueError("QEP takes the float model's hidden states (reference), and only QEP")
    if qep is not None and config_lib.is_moe_layer(cfg, layer):
        raise ValueError(f"QEP calibrates dense layers; layer {layer} is a mixture of experts")


def _run_stage(cfg, layer, index, quantized, floats, collect) -> tuple[Any, Any]:
    """Runs stage `index` on every chunk of the calibration's carries, in place, with the
    layer's weights as quantized so far (quantized: (weights, carries)), and on QEP's float
    stream with the float weights (floats: (weights, carries or None)). With `collect`, returns
    the sums H and (QEP) H_delta of the stage's input, else (None, None)."""
    (weights, carries), (source, references) = quantized, floats
    h = h_delta = None
    for i, carry in enumerate(carries):
        # In place: a chunk's input is dropped as its output is made, so a stage holds one set
        # of hidden states (plus one chunk), not its inputs and outputs both.
        carries[i] = _stage(cfg, layer, index, weights, carry)
        if references is not None:
            references[i] = _stage(cfg, layer, index, source, references[i])
        if collect:
            h = hessian.add(h, carries[i]["x"])
            if references is not None:
                h_delta = hessian.add_delta(h_delta, references[i]["x"], carries[i]["x"])
    return h, h_delta


def _experts(cfg, prefix, current, carries, plans, options, observe, all_experts):
    return moe_calibration.calibrate_block(
        cfg, current, carries, plans, options,
        all_experts=all_experts, observe=observe, prefix=prefix,
    )  # fmt: skip


def run_layer(
    cfg: config_lib.LmConfig, layer: int, weights: Mapping[str, jax.Array], hidden: Hidden
) -> Hidden:
    """Decoder layer `layer` on every chunk (the evaluation's streams)."""
    current = _as_float(weights)
    return tuple(forward.layer_forward(cfg, layer, current, h) for h in hidden)


def embed(cfg: config_lib.LmConfig, outer: Mapping[str, jax.Array], ids: Sequence) -> Hidden:
    """The hidden states entering layer 0, chunk by chunk of token ids."""
    return tuple(forward.embed(cfg, outer, jnp.asarray(chunk)) for chunk in ids)


def perplexity(
    cfg: config_lib.LmConfig,
    outer: Mapping[str, jax.Array],
    hidden: Hidden,
    ids: Sequence,
) -> float:
    """exp(mean next-token NLL) over every window, from the last layer's hidden states."""
    total, count = 0.0, 0
    for h, chunk in zip(hidden, ids, strict=True):
        nll = forward.token_nll(cfg, outer, h, jnp.asarray(chunk))
        total += float(np.sum(np.asarray(nll), dtype=np.float64))
        count += chunk.shape[0] * (chunk.shape[1] - 1)
    return float(np.exp(total / count))
