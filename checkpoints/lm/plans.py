"""The recipe's plan of each tensor of a language model calibrated layer by layer, as the
checkpoint pipeline will make it (calibration.py's layers quantize the linears it plans)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


class Plans:
    """The recipe's LeafPlan of each tensor, as the checkpoint pipeline will make it."""

    def __init__(self, recipe: Mapping[str, Any], entries: Mapping, dtypes: Mapping) -> None:
        from qmill.engine.modelfree import recipes

        self._recipe = recipes.recipe_from_mapping(recipe)
        self._entries, self._dtypes = entries, dtypes

    def plan(self, name: str) -> Any:
        from qmill.engine.modelfree import layout

        return layout.plan_leaf(name, self._entries[name], self._dtypes[name], self._recipe)

    def linears(self, cfg: Any, layer: int, prefix: str) -> dict[str, Any]:
        """Relative name → plan of the layer's linears the recipe quantizes."""
        from qmill.engine.lm import config as config_lib

        plans = {n: self.plan(n) for n in config_lib.linear_names(cfg, layer)}
        return {n.removeprefix(prefix): p for n, p in plans.items() if p.quantize}

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
