"""AWQ's weight clipping (Lin et al., arXiv:2306.00978; the authors' llm-awq runs it after the
scale search): each quantization group of a smoothed linear's row may be clamped to a fraction of
its absmax before round to nearest. A narrower range rounds the group's other values more finely,
at the cost of the values clamped; which wins depends on the inputs, so the fraction is chosen
per (row, group) by the error it causes in the linear's output over the calibration tokens.

Lingo (awq.py and folds.py for the rest):
  group    the values of one quantization scale along a row: a tile of columns, or the row.
  shrink   the fraction of the group's absmax kept: 1 (no clipping: round to nearest's own
           choice, so the error never grows), 0.95, ..., 0.55 (llm-awq's grid: 20 steps, at most
           half the range).
  H_g      the group's diagonal block of the input's Gram matrix Σ xᵀx over every calibration
           token. For δ = W_g − Q(clamp(W_g)) the output error of the group is δ · H_g · δᵀ: the
           squared difference of the group's part of the output summed over the tokens, which
           llm-awq computes on a sample of 512 of them; here every token counts.

As in llm-awq, q_proj and k_proj (and a fused qkv_proj) are left unclipped: their error reaches
the layer's output through the softmax, which the linear's own output error does not measure.
Only linears whose scales each cover one row's group are clipped (a scale over several rows
would take the largest of their clamps). llm-compressor does not clip (docs/calibrated-methods.md).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.core import qarray_parts
from qmill.engine.lm import awq as awq_lib
from qmill.engine.lm import config as config_lib
from qmill.engine.lm import folds as folds_lib
from qmill.engine.lm import forward
from qmill.engine.modelfree import layout

_F32 = jnp.float32
# llm-awq's grid: shrink 1 − i / 20 for i < 0.5 · 20.
SHRINKS = tuple(1.0 - i / 20 for i in range(10))
# Left unclipped (module docstring).
_UNCLIPPED = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.qkv_proj.weight")


def clippable(name: str, plan: layout.LeafPlan, shape: tuple[int, ...]) -> int | None:
    """The group size along the row if `name` is clipped (module docstring), else None."""
    if name in _UNCLIPPED or len(shape) != 2 or plan.global_scale is not None:
        return None
    tiles = dict(plan.tiled_axes)
    if 0 in tiles or 0 not in plan.channelwise_axes:
        return None  # a scale over several rows
    group = int(tiles.get(1, shape[1]))
    return group if shape[1] % group == 0 else None


def clip_layer(
    cfg: config_lib.LmConfig,
    layer: int,
    weights: Mapping[str, jax.Array],
    hidden: Sequence[jax.Array],
    plans: Mapping[str, layout.LeafPlan],
) -> tuple[dict[str, jax.Array], dict[str, dict[str, Any]]]:
    """The smoothed layer `weights` with each clippable linear of `plans` clamped group by group
    (float32), and per clipped linear {"clipped_groups": the share of groups clamped,
    "group_error", "rtn_group_error": the groups' output errors δ · H_g · δᵀ summed over groups
    and rows, with and without the clamps}."""
    by_stage: dict[int, list[tuple[str, int]]] = {}
    for fold in folds_lib.table(cfg, folds_lib.AWQ, layer):
        for name in fold.balance:
            if name not in plans:
                continue
            group = clippable(name, plans[name], jnp.shape(weights[name]))
            if group is not None:
                by_stage.setdefault(fold.stage, []).append((name, group))
    out, report = dict(weights), {}
    # Stage by stage, as the search runs them: one stage's input held at a time.
    carries = [{"h": h} for h in hidden]
    for index in range(max(by_stage, default=-1) + 1):
        step = forward.stage_fn(cfg, layer, index)
        carries = [step(weights, c) for c in carries]
        if index not in by_stage:
            continue
        gram = sum(awq_lib.gram(c["x"]) for c in carries)
        for name, group in by_stage[index]:
            how = awq_lib.how_to_quantize(plans[name])
            clipped, share, errors = _search(jnp.asarray(weights[name]), gram, how, group)
            out[name] = clipped
            errors = np.asarray(errors, np.float64)
            report[name] = {
                "clipped_groups": float(share),
                "group_error": float(errors[1]),
                "rtn_group_error": float(errors[0]),
            }
    return out, report


@functools.partial(jax.jit, static_argnames=("how", "group"))
def _search(
    w: jax.Array, gram: jax.Array, how: qarray_parts.HowToQuantize, group: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """w clamped per (row, group) at the shrink of least output error; the share of groups
    clamped; the errors without and with the clamps."""
    rows, width = w.shape
    groups = width // group
    w = w.astype(_F32)
    blocks = _diagonal_blocks(gram, groups, group)
    absmax = jnp.max(jnp.abs(w.reshape(rows, groups, group)), axis=-1, keepdims=True)

    def group_errors(limit: jax.Array) -> tuple[jax.Array, jax.Array]:
        clamped = jnp.clip(w.reshape(rows, groups, group), -limit, limit).reshape(rows, width)
        q = awq_lib.fake_quantize(clamped, jnp.ones((width,), _F32), how)
        d = (w - q).reshape(rows, groups, group)
        return jnp.einsum("rgk,gkl,rgl->rg", d, blocks, d, precision="highest"), clamped

    unclipped, _ = group_errors(absmax)  # SHRINKS[0] = 1: round to nearest's own range
    best, best_limit = unclipped, absmax
    for shrink in SHRINKS[1:]:
        limit = absmax * shrink
        err, _ = group_errors(limit)
        better = err < best
        best = jnp.where(better, err, best)
        best_limit = jnp.where(better[..., None], limit, best_limit)
    _, clamped = group_errors(best_limit)
    share = jnp.mean((best_limit < absmax).astype(_F32))
    return clamped, share, jnp.stack([jnp.sum(unclipped), jnp.sum(best)])


def _diagonal_blocks(gram: jax.Array, groups: int, group: int) -> jax.Array:
    """(groups, group, group): the blocks of `gram` on its diagonal."""
    tiled = gram.reshape(groups, group, groups, group)
    index = jnp.arange(groups)
    return tiled[index, :, index, :]
