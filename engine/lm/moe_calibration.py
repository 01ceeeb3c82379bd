"""GPTQ of a mixture-of-experts block, expert by expert, on the tokens routed to each.

sequential.calibrate_layer hands its "experts" stage here (forward.stages): the block's input
x for every chunk and the residual stream. Per expert, in the sequential scheme within it:
  1. gate and up are GPTQ'd with H = Σ xᵀx over the rows of x routed to it (every row with
     `all_experts`: llm-compressor's calibrate-all-experts, which gives every expert the
     statistics of every token),
  2. down with the Hessian of its input act(x W_gate'ᵀ) * (x W_up'ᵀ), made with the quantized
     gate and up, over the same rows,
  3. its output, with every weight quantized, added to the block's for its routed tokens only
     (weighted by the router's probabilities), whatever the statistics' rows were.
The routing is decided once, on the block's input (the router is never quantized), so the
layer's output is the quantized layer's as a user's model computes it.

An expert no statistics row reaches has nothing to calibrate on: it is quantized round to
nearest, and named with the reason (`BlockCalibration.rtn`). One expert's rows and Hessians are
held at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.contrib import gptq_core
from qmill.engine.contrib import leaf as contrib_leaf
from qmill.engine.core import qarray_parts
from qmill.engine.lm import config as config_lib
from qmill.engine.lm import hessian, moe, moe_config
from qmill.engine.modelfree import layout
from qmill.engine.modelfree import leaf as leaf_lib

NO_TOKENS = "no calibration token was routed to this expert: round to nearest"


@dataclasses.dataclass(frozen=True)
class BlockCalibration:
    """What calibrating one MoE block gave (names relative to the layer's prefix)."""

    results: dict[str, leaf_lib.LeafResult]
    losses: dict[str, float]
    # Linears quantized round to nearest → why.
    rtn: dict[str, str]
    # Per chunk, the layer's output (B, T, D): the residual stream plus the quantized block's.
    hidden: list[jax.Array]


def _rtn(weight: jax.Array, plan: layout.LeafPlan) -> tuple[leaf_lib.LeafResult, jax.Array]:
    """Round to nearest, and the weight its codes stand for (float32, the tensor's layout)."""
    result = leaf_lib.quantize_leaf(np.asarray(weight), plan)
    zero_point = None if result.zero_point is None else jnp.asarray(result.zero_point)
    deq = qarray_parts.dequantize_bytes(
        jnp.asarray(result.codes()), plan.qtype, jnp.asarray(result.scale), zero_point
    )
    return result, jnp.asarray(deq, jnp.float32).reshape(weight.shape)


class _Block:
    """One block's state across its experts: the inputs, the routes, the outputs so far."""

    def __init__(self, cfg: config_lib.LmConfig, weights, xs: Sequence[jax.Array]) -> None:
        self.cfg = cfg
        self.xs = [x.reshape(-1, x.shape[-1]).astype(jnp.float32) for x in xs]
        self.routes = [moe.route(cfg, weights, x) for x in self.xs]
        self.outs = [jnp.zeros_like(x) for x in self.xs]

    def rows(self, weights, e: int | str, every: bool) -> list[tuple[jax.Array, jax.Array, int]]:
        """Per chunk, expert e's (padded indices, weights, count): its routed tokens, or every
        token (weights 1) when `every`."""
        out = []
        for x, (top, index) in zip(self.xs, self.routes, strict=True):
            tokens, w = moe.token_weights(self.cfg, weights, top, index, x, e)
            if every and e != "shared":
                tokens, w = np.arange(len(x), dtype=np.int32), np.ones(len(x), np.float32)
            out.append((*moe.padded_rows(tokens, w), len(tokens)))
        return out

    def add(self, weights, e: int | str) -> None:
        """Expert e's output (its weights as they are now) on its routed tokens."""
        gate, up, down = (weights[n] for n in moe_config.expert(self.cfg.moe, e))
        for c, (i, w, n) in enumerate(self.rows(weights, e, False)):
            if n:
                m = moe.hidden(self.cfg.activation, moe.gather(self.xs[c], i, n), gate, up)
                self.outs[c] = moe.add_output(self.outs[c], m, down, i, w)


Observer = Callable[[tuple[str, ...], Sequence[jax.Array]], None]


def calibrate_block(
    cfg: config_lib.LmConfig,
    weights: dict[str, jax.Array],
    carries: Sequence[Mapping[str, jax.Array]],
    plans: Mapping[str, layout.LeafPlan],
    options: gptq_core.GptqOptions,
    *,
    all_experts: bool = False,
    observe: Observer | None = None,
    prefix: str = "",
) -> BlockCalibration:
    """Calibrates the block whose input is each carry's "x" (module docstring); `weights`
    (relative names, float32) gets each quantized expert's weights in place.

    Args:
      plans: relative name → LeafPlan of the experts' linears to quantize (others stay float).
      all_experts: every token through every expert for the statistics.
      observe: given, sees each expert's linears' inputs (full names: `prefix` + name), its
        statistics rows only.
    """
    block = _Block(cfg, weights, [c["x"] for c in carries])
    results: dict[str, leaf_lib.LeafResult] = {}
    losses: dict[str, float] = {}
    rtn: dict[str, str] = {}
    for e in moe_config.experts(cfg.moe):
        gate, up, down = moe_config.expert(cfg.moe, e)
        stats = block.rows(weights, e, all_experts)
        reached = any(n for *_, n in stats)
        inputs = [moe.gather(x, i, n) for x, (i, _, n) in zip(block.xs, stats, strict=True)]
        done = (results, losses, rtn)
        _quantize(weights, [gate, up], plans, inputs, options, reached, done)
        _observe(observe, (prefix + gate, prefix + up), inputs, stats)
        act = cfg.activation
        mids = [moe.hidden(act, r, weights[gate], weights[up]) for r in inputs]
        del inputs
        _quantize(weights, [down], plans, mids, options, reached, done)
        _observe(observe, (prefix + down,), mids, stats)
        del mids
        block.add(weights, e)
    hidden = [
        carry["h"].astype(jnp.float32) + out.reshape(carry["h"].shape)
        for carry, out in zip(carries, block.outs, strict=True)
    ]
    return BlockCalibration(results, losses, rtn, hidden)


def _observe(observe, names, inputs: Sequence[jax.Array], stats) -> None:
    """The statistics rows (not the padding) of each chunk that has some: an expert no token
    reached is not observed (its linears get no input range)."""
    if observe is None:
        return
    valid = [x[:n] for x, (_, _, n) in zip(inputs, stats, strict=True) if n]
    if valid:
        observe(names, valid)


def _quantize(weights, names, plans, inputs, options, reached: bool, done) -> None:
    """GPTQ of `names` (one input) with the Hessian of `inputs`, or round to nearest when no
    row `reached` them; the quantized weights replace theirs in `weights`, what it gave goes
    to `done` (results, losses, rtn)."""
    results, losses, rtn = done
    targets = [n for n in names if n in plans]
    if not targets:
        return
    if not reached:
        for name in targets:
            results[name], weights[name] = _rtn(weights[name], plans[name])
            rtn[name] = NO_TOKENS
        return
    h = hessian.of(inputs)
    gptqd = contrib_leaf.gptq_static_leaves(
        [weights[n] for n in targets], [plans[n] for n in targets], h, options
    )
    for name, (result, deq, loss) in zip(targets, gptqd, strict=True):
        results[name], weights[name], losses[name] = result, deq, loss
