"""Quantized training (QT): fake quantization with a straight-through estimator.

Forward: each operand of a matched op is quantized and dequantized ("fake quant"), so the float op
sees exactly the values a PTQ model will compute with; the gradient passes straight through the
rounding. Backward (``bwd_qtype``): the output gradient is fake-quantized too, once for the
operand-gradient and once, optionally tiled along the batch axis, for the weight-gradient.

Static-range activations keep additive statistics (averaging.py) in the ``quant_stats`` collection
(Linen) or ``QuantStat`` variables (NNX), named ``<op_id>_{lhs,rhs}``; quantize_params and the
NNX PtqProvider turn them into static scales.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from qmill.engine import averaging, flax_util, qarray, rules
from qmill.engine.providers import base, op_adapter


class QuantStat(nnx.Variable):
    """NNX variable holding a static-range statistic ({"count", "sum_of_..."})."""


_DEFAULT_QT = rules.QtRule()


def _qt_setting(rule: rules.QuantizationRule, name: str) -> Any:
    # Plain QuantizationRules are accepted and behave as QtRules with default QT settings.
    return getattr(rule, name, getattr(_DEFAULT_QT, name))


def _fake_quant(x: jax.Array, how: qarray.HowToQuantize) -> jax.Array:
    return qarray.dequantize(qarray.quantize(jax.lax.stop_gradient(x), how)).astype(x.dtype)


def _ste(x: jax.Array, fq: jax.Array) -> jax.Array:
    return x + jax.lax.stop_gradient(fq - x)


class QtProvider(base.QuantizationProvider):
    """Fake-quantized forward (and optionally backward) for quantization-aware training."""

    def __init__(self, rules_: Sequence[rules.QuantizationRule]) -> None:
        super().__init__(rules_)

    def dot_general(
        self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs
    ) -> jax.Array:
        def compute(a, b):
            return jax.lax.dot_general(a, b, dimension_numbers, precision, preferred_element_type)

        rule, op_id, module = self.current_rule_and_op_id("dot_general")
        if rule is None or rule.weight_qtype is None:
            return jax.lax.dot_general(
                lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs
            )
        how = functools.partial(
            op_adapter.dot_general_how,
            dimension_numbers=dimension_numbers,
            ndims=(lhs.ndim, rhs.ndim),
            tile_size=rule.tile_size,
        )
        return self._run(rule, op_id, module, lhs, rhs, how, compute)

    def einsum(self, einsum_str, *operands, **kwargs) -> jax.Array:
        rule, op_id, module = self.current_rule_and_op_id("einsum")
        if rule is None or rule.weight_qtype is None or len(operands) != 2:
            return jnp.einsum(einsum_str, *operands, **kwargs)
        lhs, rhs = operands
        how = functools.partial(
            op_adapter.einsum_how,
            einsum_str=einsum_str,
            ndims=(lhs.ndim, rhs.ndim),
            tile_size=rule.tile_size,
        )
        kwargs.pop("_dot_general", None)
        return self._run(
            rule, op_id, module, lhs, rhs, how, lambda a, b: jnp.einsum(einsum_str, a, b, **kwargs)
        )

    def conv_general_dilated(self, lhs, rhs, window_strides, padding, *args, **kwargs):
        def compute(a, b):
            return jax.lax.conv_general_dilated(a, b, window_strides, padding, *args, **kwargs)

        rule, op_id, module = self.current_rule_and_op_id("conv_general_dilated")
        if rule is None or rule.weight_qtype is None:
            return compute(lhs, rhs)
        dn_arg = kwargs.get("dimension_numbers", args[2] if len(args) > 2 else None)
        dn = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, dn_arg)
        how = functools.partial(op_adapter.conv_how, dimension_numbers=dn)
        return self._run(
            rule, op_id, module, lhs, rhs, lambda tile_size=None, **kw: how(**kw), compute
        )

    def dot(self, a, b, precision=None, preferred_element_type=None, **kwargs) -> jax.Array:
        if a.ndim == 0 or b.ndim == 0:
            return jnp.dot(a, b, precision=precision, preferred_element_type=None, **kwargs)
        dn = (((a.ndim - 1,), (0 if b.ndim == 1 else b.ndim - 2,)), ((), ()))
        return self.dot_general(a, b, dn, precision, preferred_element_type)

    def get_intercept_map(self) -> dict[str, Callable[..., Any]]:
        return super().get_intercept_map() | {
            "jax.lax.conv_general_dilated": self.conv_general_dilated,
            "jax.lax.dot_general": self.dot_general,
            "jax.numpy.dot": self.dot,
            **base.matmul_targets(self.dot),
            "jax.numpy.einsum": self.einsum,
        }

    # ---- the fake-quantized op ----------------------------------------------------------------

    def _run(self, rule, op_id, module, lhs, rhs, how, compute) -> jax.Array:
        operands = []
        for side, x in (("lhs", lhs), ("rhs", rhs)):
            kw = {"for_lhs": side == "lhs"}
            if flax_util.find_param(x, module) is not None:
                h = how(
                    **kw, qtype=rule.weight_qtype, calibration_method=rule.weight_calibration_method
                )
                x = _ste(x, _fake_quant(x, self._maybe_per_tensor(rule, h)))
            elif rule.act_qtype is not None:
                h = how(
                    **kw,
                    qtype=rule.act_qtype,
                    calibration_method=rule.resolved_act_calibration_method,
                )
                h = self._maybe_per_tensor(rule, h)
                name = None if op_id is None else f"{op_id}_{side}"
                x = _ste(x, self.fake_quant_act(module, x, h, rule, name))
            operands.append(x)
        if _qt_setting(rule, "bwd_qtype") is None:
            return compute(*operands)
        return _with_quantized_grad(compute, _BwdConfig.of(rule), *operands)

    def _maybe_per_tensor(self, rule, how: qarray.HowToQuantize) -> qarray.HowToQuantize:
        if _qt_setting(rule, "disable_channelwise_axes"):
            return dataclasses.replace(how, channelwise_axes=())
        return how

    def fake_quant_act(self, module, x, how, rule, act_name) -> jax.Array:
        """Fake-quantizes an activation; static scales come from the running statistic."""
        if not rule.resolved_act_static_scale or module is None or act_name is None:
            return _fake_quant(x, how)
        axes = tuple(rule.act_batch_axes)
        current = {
            k: v.mean(axis=axes, keepdims=True)
            for k, v in qarray.calibrate(jax.lax.stop_gradient(x), how).items()
        }
        stat = _get_or_init_stat(module, act_name, current)
        if _can_update(module):
            stat = averaging.update(stat, current)
            _set_stat(module, act_name, stat)
            calibration = averaging.calibration(stat)
        else:
            seen = stat["count"] > 0
            avg = averaging.calibration(stat)
            calibration = {
                k: jnp.where(seen, avg[k], v.astype(jnp.float32)) for k, v in current.items()
            }
        scale, zero_point = qarray.compute_scale_zero_point(calibration, how.qtype)
        q = qarray.quantize_with_scale_zero_point(
            jax.lax.stop_gradient(x), how.qtype, scale.astype(x.dtype), zero_point
        )
        return qarray.dequantize(q).astype(x.dtype)


def _can_update(module: Any) -> bool:
    from qmill.engine import model  # cycle: model imports the providers' base

    if isinstance(module, nn.Module):
        return module.is_mutable_collection("quant_stats") and not module.is_initializing()
    return not model.is_initializing_nnx() and not getattr(
        module, "disable_quant_stats_update", False
    )


def _get_or_init_stat(module: Any, name: str, calibration: dict[str, jax.Array]) -> dict:
    if isinstance(module, nn.Module):
        return module.variable("quant_stats", name, averaging.init, calibration).value
    existing = getattr(module, name, None)
    if isinstance(existing, QuantStat):
        return existing.get_value()
    stat = averaging.init(calibration)
    setattr(module, name, QuantStat(stat))
    return stat


def _set_stat(module: Any, name: str, stat: dict) -> None:
    if isinstance(module, nn.Module):
        module.put_variable("quant_stats", name, stat)
    else:
        getattr(module, name).set_value(stat)


# ---- quantized backward pass ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _BwdConfig:
    qtype: Any
    calibration_method: str
    weight_grad_tile_size: int | float | None
    stochastic_rounding: str | None
    noise_axes: tuple[int, ...]

    @classmethod
    def of(cls, rule: rules.QuantizationRule) -> _BwdConfig:
        return cls(
            _qt_setting(rule, "bwd_qtype"),
            _qt_setting(rule, "bwd_calibration_method"),
            _qt_setting(rule, "bwd_weight_grad_tile_size"),
            _qt_setting(rule, "bwd_stochastic_rounding"),
            tuple(_qt_setting(rule, "channelwise_noise_axes")),
        )


def _noise_fn(cfg: _BwdConfig, g: jax.Array) -> Callable[[tuple[int, ...]], jax.Array] | None:
    if cfg.stochastic_rounding is None:
        return None
    # A fresh key per step without threading RNG state through the model: derive it from the
    # gradient's bits (different every step, reproducible for equal inputs).
    seed = jax.lax.bitcast_convert_type(jnp.sum(g.astype(jnp.float32)), jnp.uint32)
    key = jax.random.fold_in(jax.random.key(0), seed)

    def noise(shape: tuple[int, ...]) -> jax.Array:
        shared = tuple(
            1 if a % len(shape) in {n % len(shape) for n in cfg.noise_axes} else s
            for a, s in enumerate(shape)
        )
        if cfg.stochastic_rounding == "low_bit_uniform":
            u = jax.random.randint(key, shared, 0, 256).astype(jnp.float32) / 256.0
        else:
            u = jax.random.uniform(key, shared, jnp.float32)
        return jnp.broadcast_to(u - 0.5, shape)

    return noise


def _fake_quant_grad(g: jax.Array, cfg: _BwdConfig, tile_batch: bool) -> jax.Array:
    tiled = {0: cfg.weight_grad_tile_size} if tile_batch and cfg.weight_grad_tile_size else {}
    how = qarray.HowToQuantize(
        qtype=cfg.qtype, tiled_axes=tiled, calibration_method=cfg.calibration_method
    )
    calibration = qarray.calibrate(g, how)
    scale, zero_point = qarray.compute_scale_zero_point(calibration, how.qtype)
    q = qarray.quantize_with_scale_zero_point(g, how.qtype, scale, zero_point, _noise_fn(cfg, g))
    return qarray.dequantize(q).astype(g.dtype)


def _with_quantized_grad(compute, cfg: _BwdConfig, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    @jax.custom_vjp
    def op(a, b):
        return compute(a, b)

    def fwd(a, b):
        return compute(a, b), (a, b)

    def bwd(res, g):
        a, b = res
        _, vjp = jax.vjp(compute, a, b)
        da, _ = vjp(_fake_quant_grad(g, cfg, tile_batch=False))
        _, db = vjp(_fake_quant_grad(g, cfg, tile_batch=True))
        return da, db

    op.defvjp(fwd, bwd)
    return op(lhs, rhs)
