"""Each linear's input range on calibration tokens, for a Hugging Face causal-LM folder whose
weights are rounded to nearest (a static-activation scheme without --method).

llm-compressor's QuantizationModifier (what its `oneshot` runs for FP8 or NVFP4 alone) watches
every Linear's input while the calibration text runs through the *float* model, layer by layer,
and only then rounds the weights. So does this: one decoder layer's tensors are read at a time
and run in float on the hidden states entering it (engine/lm/activation_ranges.py), which
carries them on to the next.

The ranges are kept beside the destination (lm_calibration.work_directory, as GPTQ's work is)
until the output is committed: an interrupted write resumes with the same input scales, and a
rerun with other tokens is refused unless restarted.

Memory: one layer's weights, the embedding and the calibration hidden states (float32).
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from qmill.checkpoints.base import files
from qmill.checkpoints.formats import registry as formats
from qmill.checkpoints.formats.compressed_tensors import activations as ct_activations
from qmill.checkpoints.lm import calibration as lm_calibration
from qmill.checkpoints.lm import work as lm_work
from qmill.checkpoints.run import embedded
from qmill.checkpoints.run import plan as plan_lib

Range = ct_activations.Range
RANGES = "input_ranges.json"
# A mixture of experts' expert linear (engine/lm/moe_config.expert: Mixtral's and Qwen's).
_EXPERT = re.compile(r"\.experts\.\d+\.")


def collect(
    folder: str,
    calibration_ids: np.ndarray,
    *,
    chunk: int = 8,
    all_experts: bool = False,
    progress: Callable[[int, int, float], None] | None = None,
) -> dict[str, Range]:
    """{linear weight name: its input's (min, max)} over `calibration_ids` (int, samples ×
    tokens), the float model run layer by layer; `progress(layer, layers, seconds)` after each.
    A mixture of experts' experts see the tokens routed to them, or every token with
    `all_experts` (activation_ranges.layer_ranges).

    Raises:
      ValueError: an unsupported architecture, missing tensors or token ids outside the
        vocabulary (lm_calibration.check_request), before any work.
    """
    import jax.numpy as jnp

    from qmill.engine.lm import activation_ranges, sequential
    from qmill.engine.lm import config as config_lib

    ids = np.asarray(calibration_ids)
    cfg = lm_calibration.check_request(
        folder, lm_calibration.LmRequest(calibration_ids=ids, all_experts=all_experts)
    )
    embedded.load_engine()
    ranges: dict[str, Range] = {}
    with formats.open_source(folder) as source:
        names = config_lib.outer_tensor_names(cfg)
        outer = {key: jnp.asarray(source.read(name)) for key, name in names.items() if name}
        hidden = sequential.embed(cfg, outer, sequential.split(ids.astype(np.int32), chunk))
        for layer in range(cfg.num_layers):
            started = time.monotonic()
            prefix = config_lib.layer_prefix(cfg, layer)
            weights = {
                n.removeprefix(prefix): source.read(n)
                for n in config_lib.layer_tensor_names(cfg, layer)
            }
            found, hidden = activation_ranges.layer_ranges(
                cfg, layer, weights, hidden, all_experts=all_experts
            )
            ranges.update(found)
            if progress is not None:
                progress(layer, cfg.num_layers, time.monotonic() - started)
    return ranges


def kept_or_collect(
    folder: str,
    destination: str | os.PathLike,
    recipe: Mapping[str, Any],
    calibration_ids: np.ndarray,
    *,
    restart: bool = False,
    all_experts: bool = False,
    progress: Callable[[int, int, float], None] | None = None,
    notice: Callable[[str], None] | None = None,
) -> dict[str, Range]:
    """`collect`'s ranges, kept beside `destination` by an earlier run with the same source,
    recipe, tokens and `all_experts` if there is one (`restart` discards it, and so does
    another qmill version, saying so to `notice`: lm_work.Work), else collected and kept.

    Raises:
      ValueError: kept work made with other arguments (pass restart), or collect's.
    """
    ids = np.ascontiguousarray(calibration_ids, np.int32)
    fingerprint = {
        "input_ranges_of": os.path.abspath(folder),
        "recipe": lm_work.canonical_recipe(recipe),
        "tokens": lm_work.tokens_digest(ids),
        # Only where set: ranges kept before the option existed still match.
        **({"all_experts": True} if all_experts else {}),
    }
    directory = lm_calibration.work_directory(destination)
    work = lm_work.Work(directory, fingerprint, restart, notice=notice)
    kept = work.directory / RANGES
    if kept.is_file():
        return {name: (lo, hi) for name, (lo, hi) in json.loads(kept.read_text()).items()}
    ranges = collect(folder, ids, all_experts=all_experts, progress=progress)
    # floats' repr: the same numbers read back.
    files.write_durably(kept, json.dumps(ranges).encode())
    return ranges


def input_parts(
    plan: plan_lib.Plan, ranges: Mapping[str, Range], *, hint: str = ""
) -> dict[str, dict[str, np.ndarray]]:
    """{weight path: {input part: scale}} (ct_activations.input_parts) for every weight the
    run's `plan` quantizes in its static scheme.

    Raises:
      ValueError: a weight the plan quantizes whose input is not in `ranges` (only the decoder
        layers' linears are observed; `hint` is added to the message).
    """
    quantized = [t.entry for t in plan.tensors if t.quantized]
    missing = [e.path for e in quantized if e.path not in ranges]
    experts = [name for name in missing if _EXPERT.search(name)]
    if experts:
        raise ValueError(
            f"{experts[0]} would be quantized in {plan.scheme.name}, but no calibration token "
            f"was routed to its expert ({len(experts)} such linears), so its input has no "
            "range: add --calibrate-all-experts (every token through every expert for the "
            "ranges, as llm-compressor's calibrate-all-experts) or more calibration tokens"
        )
    if missing:
        raise ValueError(
            f"{missing[0]} would be quantized in {plan.scheme.name}, but its input was not seen "
            f"on the calibration tokens{hint}: only the decoder layers' linears are; leave it in "
            "float with a skip rule in a recipe file"
        )
    seen = {e.path: ranges[e.path] for e in quantized}
    return ct_activations.input_parts(plan.scheme, seen, {e.path: e.dtype for e in quantized})
