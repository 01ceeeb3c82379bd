"""QT of ops without a QT op of their own (ragged_dot): the float op on fake-quantized operands,
and with ``bwd_qtype`` its output gradient fake-quantized before each operand's gradient.

For the lhs gradient (g contracted with rhs over rhs's free axes) g gets one scale per index of
its batch and lhs axes; for the rhs gradient one per index of its batch and rhs axes.
disable_channelwise_axes makes both one scale per tensor. For the *weight's* gradient,
bwd_weight_grad_tile_size also tiles the last axis that gradient contracts, so that a few
outlier examples don't flatten the scale of all the others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from qmill.engine.core import qarray, qtypes, stochastic_rounding
from qmill.engine.ops import op_adapter
from qmill.engine.providers import qt_ops


def qt_option(rule: Any, name: str, default: Any) -> Any:
    """A DotGeneralQtConfig field set through the rule's ``additional_qt_config`` (the
    reference's override); ``sparsity_rule`` may also be a field of the rule itself."""
    extra = getattr(rule, "additional_qt_config", None) or {}
    return extra.get(name, getattr(rule, name, default))


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    qtype: Any
    calibration_method: str
    weight_grad_tile_size: int | float | None
    stochastic_rounding: str | None
    noise_axes: tuple[int, ...]
    per_tensor: bool
    layout: op_adapter.GradLayout
    weight_side: str | None  # "lhs", "rhs" or None (two activations)
    # Per side ("lhs", "rhs"): the reference's DotGeneralQtConfig overrides given through
    # additional_qt_config (dlhs_grad_qtype, drhs_tile_size, ...); None where not given.
    qtype_by_side: tuple[Any, Any] = (None, None)
    tile_by_side: tuple[Any, Any] = (None, None)

    @classmethod
    def of(cls, rule, layout: op_adapter.GradLayout, weight_side: str | None) -> BwdConfig:
        bwd_qtype = qt_ops.setting(rule, "bwd_qtype")
        return cls(
            bwd_qtype,
            qt_ops.setting(rule, "bwd_calibration_method"),
            qt_ops.setting(rule, "bwd_weight_grad_tile_size"),
            qt_ops.setting(rule, "bwd_stochastic_rounding"),
            tuple(qt_ops.setting(rule, "channelwise_noise_axes")),
            qt_ops.setting(rule, "disable_channelwise_axes"),
            layout,
            weight_side,
            tuple(qt_option(rule, f"{p}_grad_qtype", None) or bwd_qtype for p in ("dlhs", "drhs")),
            tuple(qt_option(rule, f"{p}_tile_size", None) for p in ("dlhs", "drhs")),
        )


def stochastic_noise_fn(
    method: str,
    key: jax.Array,
    noise_axes: Sequence[int] = (0,),
    *,
    channelwise_noise_axes: Sequence[int] | None = None,
) -> stochastic_rounding.NoiseFn:
    """stochastic_rounding.get_noise_fn, with the noise axes also by position (``noise_axes``)
    and the noise broadcast to the full shape asked for.

    The noise varies along ``channelwise_noise_axes`` only. "uniform" draws float noise,
    "low_bit_uniform" 8-bit noise.
    """
    axes = noise_axes if channelwise_noise_axes is None else channelwise_noise_axes
    noise = stochastic_rounding.get_noise_fn(method, key, axes)
    return dataclasses.replace(noise, full_shape=True)


def rounding_key(module: Any, cfg: BwdConfig) -> jax.Array | None:
    """Raw key data for stochastic rounding, drawn in the forward pass; None = derive it later.

    Linen models get it from a "stochastic_rounding" rng stream when the caller passes one
    (``apply(..., rngs={"stochastic_rounding": key})``). Otherwise the backward pass derives a
    key from the gradient's bits: different every step, reproducible for equal inputs.
    """
    if cfg.stochastic_rounding is None:
        return None
    if isinstance(module, nn.Module) and module.has_rng("stochastic_rounding"):
        return jax.random.key_data(module.make_rng("stochastic_rounding"))
    return None


def quantize_grad(
    g: jax.Array, cfg: BwdConfig, side: str, key: jax.Array | None = None
) -> jax.Array:
    """Fake-quantizes the output gradient g for the gradient of operand ``side``."""
    layout = cfg.layout
    own = layout.lhs_free if side == "lhs" else layout.rhs_free
    contracted = layout.rhs_free if side == "lhs" else layout.lhs_free
    channelwise = () if cfg.per_tensor else (*layout.batch, *own)
    index = 0 if side == "lhs" else 1
    qtype, tile = cfg.qtype_by_side[index] or cfg.qtype, cfg.tile_by_side[index]
    if tile is None and side == cfg.weight_side:
        tile = cfg.weight_grad_tile_size
    # mx / nv formats come with their block, as the reference infers it.
    tile = tile or qtypes.get(qtype).required_tile
    # The last axis the gradient contracts, as the reference tiles it.
    tiled = {contracted[-1]: tile} if tile and contracted else {}
    noise = (
        None if key is None else stochastic_noise_fn(cfg.stochastic_rounding, key, cfg.noise_axes)
    )
    how = qarray.HowToQuantize(
        qtype=qtype,
        channelwise_axes=channelwise,
        tiled_axes=tiled,
        calibration_method=cfg.calibration_method,
        noise_fn=noise,
    )
    return qarray.dequantize(qarray.quantize(g, how)).astype(g.dtype)


def with_quantized_grad(
    compute: Callable[[jax.Array, jax.Array], jax.Array],
    cfg: BwdConfig,
    key_data,
    lhs: jax.Array,
    rhs: jax.Array,
) -> jax.Array:
    """compute(lhs, rhs), its output gradient fake-quantized for each operand's gradient."""

    @jax.custom_vjp
    def op(a, b, key_data):
        return compute(a, b)

    def fwd(a, b, key_data):
        return compute(a, b), (a, b, key_data)

    def bwd(res, g):
        a, b, key_data = res
        keys = (None, None)
        if cfg.stochastic_rounding is not None:
            if key_data is None:
                seed = jax.lax.bitcast_convert_type(jnp.sum(g.astype(jnp.float32)), jnp.uint32)
                key = jax.random.fold_in(jax.random.key(0), seed)
            else:
                key = jax.random.wrap_key_data(key_data)
            keys = (jax.random.fold_in(key, 0), jax.random.fold_in(key, 1))
        _, vjp = jax.vjp(compute, a, b)
        da, _ = vjp(quantize_grad(g, cfg, "lhs", keys[0]))
        _, db = vjp(quantize_grad(g, cfg, "rhs", keys[1]))
        return da, db, None

    op.defvjp(fwd, bwd)
    return op(lhs, rhs, key_data)
