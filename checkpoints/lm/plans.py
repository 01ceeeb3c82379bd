"""Each tensor's plan for a language model calibrated layer by layer, as the run's plan decided it
(checkpoints/run/plan.py, the one place a recipe is read): calibration.py's layers quantize the
linears it plans, and its evaluation the embedding and head as the output holds them."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from qmill.checkpoints.base import protocols
from qmill.checkpoints.formats.compressed_tensors import schemes as ct_schemes
from qmill.checkpoints.formats.hf_folder import folder as hf_folder
from qmill.checkpoints.formats.hf_folder import untied as hf_untied
from qmill.checkpoints.run import plan as plan_lib

# The skip rule that leaves a mixture of experts' routers (and Qwen2-MoE's shared expert gate) in
# the source dtype: every compressed-tensors preset's own.
ROUTERS_KEPT = {"path_regex": ct_schemes.ROUTER_IGNORE_REGEX, "skip": True}


def keeping_routers(recipe: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe a language model is calibrated with: whatever its rules say, a mixture of
    experts' routers stay in the source dtype (ROUTERS_KEPT first), since the calibration
    decides the routing on the float router and its perplexity is the float router's; and
    transformers 5 loads a router as a plain parameter, never a quantized Linear. A recipe
    whose leading skip rules hold ROUTERS_KEPT already (every compressed-tensors preset) is
    returned as it is: its kept work and server calibration ids stay the same."""
    rules = list(recipe.get("rules") or ())
    for rule in rules:
        if not rule.get("skip"):
            break
        if rule.get("path_regex") == ROUTERS_KEPT["path_regex"]:
            return dict(recipe)
    return {**recipe, "rules": [dict(ROUTERS_KEPT), *rules]}


def for_calibration(
    weights: protocols.TensorSource,
    folder: str | os.PathLike,
    destination: str | os.PathLike,
    recipe: Mapping[str, Any],
    untie: tuple[str, str] | None = None,
) -> Plans:
    """Each tensor's plan, made by the run's plan as the calibration quantizes the linears: at
    their own shapes, planned for the folder's own format (no output format's padded blocks or
    global scales enter the calibration; the recipe's tiles are checked on every tensor).
    `untie`: the output's head is a tensor of its own (plan.make's), planned as it will be."""
    source: Any = weights
    if untie is not None:
        source = hf_untied.untied(hf_folder.HfFolderSource(pathlib.Path(folder), weights), untie)
    planned = plan_lib.plan_source(
        source, folder, destination, dict(recipe), weights.format, untie=untie
    )
    return Plans(planned)


class Plans:
    """The LeafPlan of each tensor of a run's plan, read by layer."""

    def __init__(self, planned: plan_lib.Plan) -> None:
        if not planned.resolved:
            raise ValueError(
                "a language model's calibration needs each tensor's plan (engine=True)"
            )
        # None for a dtype that is never quantized (integers, bool).
        self._leaves = {t.path: t.leaf for t in planned.tensors}

    def plan(self, name: str) -> Any:
        """The tensor's LeafPlan (None: its dtype is never quantized)."""
        return self._leaves[name]

    def linears(self, cfg: Any, layer: int, prefix: str) -> dict[str, Any]:
        """Relative name → plan of the layer's linears the recipe quantizes."""
        from qmill.engine.lm import config as config_lib

        plans = {n: self.plan(n) for n in config_lib.linear_names(cfg, layer)}
        return {n.removeprefix(prefix): p for n, p in plans.items() if p is not None and p.quantize}

    def outer_as_quantized(self, cfg: Any, outer: Mapping[str, Any]) -> dict[str, Any]:
        """The embedding and head as the quantized model has them: round-to-nearest where the
        recipe quantizes them (qmill's own recipes do; compressed-tensors schemes don't)."""
        import jax.numpy as jnp

        from qmill.engine.core import qarray_parts
        from qmill.engine.lm import config as config_lib
        from qmill.engine.modelfree import leaf

        out = dict(outer)
        for key, name in config_lib.outer_tensor_names(cfg).items():
            plan = self.plan(name) if name else None
            if plan is None or not plan.quantize:
                continue
            result = leaf.quantize_leaf(np.asarray(outer[key]), plan)
            zero_point = None if result.zero_point is None else jnp.asarray(result.zero_point)
            out[key] = qarray_parts.dequantize_bytes(
                jnp.asarray(result.codes()), plan.qtype, jnp.asarray(result.scale), zero_point
            )
        return out
