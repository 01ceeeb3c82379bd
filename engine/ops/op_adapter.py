"""The providers' single door to the quantized ops of ``qmill.engine.ops``.

Each ``*_how`` binds what an op call and its rule fix (dimension numbers, operand ranks, tile
size) and returns a ``HowFor``, which the providers then ask, keyword-only, how to quantize each
operand (``for_lhs=``, ``qtype=``, ``calibration_method=``): the same way for every op.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax

from qmill.engine.core import qarray
from qmill.engine.modeling import rules
from qmill.engine.ops import conv_general as conv_general_lib
from qmill.engine.ops import dot_general as dot_general_lib
from qmill.engine.ops import einsum as einsum_lib


@dataclasses.dataclass(frozen=True)
class HowFor:
    """How to quantize either operand of one op call under its rule.

    Ask it keyword-only (``how(for_lhs=, qtype=, calibration_method=)``), or for the rule's own
    weight or activation settings (``how.weight(for_lhs)``, ``how.act(for_lhs)``).
    """

    get: Callable[..., qarray.HowToQuantize]
    rule: rules.QuantizationRule

    def __call__(self, **kwargs: Any) -> qarray.HowToQuantize:
        return self.get(**kwargs)

    def weight(self, for_lhs: bool) -> qarray.HowToQuantize:
        """How to quantize the operand as a weight: the rule's weight qtype and calibration."""
        qtype, method = self.rule.weight_qtype, self.rule.weight_calibration_method
        return self.get(for_lhs=for_lhs, qtype=qtype, calibration_method=method)

    def act(self, for_lhs: bool) -> qarray.HowToQuantize:
        """How to quantize the operand as an activation: the rule's act qtype and calibration."""
        qtype, method = self.rule.act_qtype, self.rule.resolved_act_calibration_method
        return self.get(for_lhs=for_lhs, qtype=qtype, calibration_method=method)


def dot_general_how(rule: rules.QuantizationRule, lhs, rhs, dimension_numbers) -> HowFor:
    """How to quantize either operand of this dot_general under ``rule``."""
    return _bind(
        dot_general_lib.get_how_to_quantize, rule, lhs, rhs, dimension_numbers=dimension_numbers
    )


def einsum_how(rule: rules.QuantizationRule, lhs, rhs, einsum_str: str) -> HowFor:
    """How to quantize either operand of this two-operand einsum under ``rule``."""
    return _bind(einsum_lib.get_how_to_quantize, rule, lhs, rhs, einsum_str=einsum_str)


def _bind(get_how, rule, lhs, rhs, **op_args) -> HowFor:
    ndims = (len(lhs.shape), len(rhs.shape))
    return HowFor(
        functools.partial(get_how, ndims=ndims, tile_size=rule.tile_size, **op_args), rule
    )


def conv_how(
    rule: rules.QuantizationRule, dimension_numbers: jax.lax.ConvDimensionNumbers
) -> HowFor:
    """How to quantize either operand of a conv (per batch item / output feature, never tiled)."""
    get = conv_general_lib.get_how_to_quantize
    return HowFor(functools.partial(get, dimension_numbers=dimension_numbers), rule)


def dot_general(lhs, rhs, dimension_numbers, **kwargs) -> jax.Array:
    return dot_general_lib.dot_general(lhs, rhs, dimension_numbers, **kwargs)


def einsum(einsum_str, lhs, rhs, **kwargs) -> jax.Array:
    return einsum_lib.einsum(einsum_str, lhs, rhs, **kwargs)


def conv_general_dilated(lhs, rhs, *args, **kwargs) -> jax.Array:
    return conv_general_lib.conv_general_dilated(lhs, rhs, *args, **kwargs)


# ---- ragged_dot (lhs [m, k], rhs [groups, k, n], out [m, n]; rows grouped by group_sizes) ------


def ragged_dot_how(rule: rules.QuantizationRule) -> HowFor:
    """lhs: a scale per row (m); rhs: a scale per (group, output column); k optionally tiled."""
    return HowFor(functools.partial(_ragged_dot_how, tile_size=rule.tile_size), rule)


def _ragged_dot_how(*, for_lhs, qtype, tile_size, calibration_method) -> qarray.HowToQuantize:
    contracting = 1
    tiled = {contracting: tile_size} if tile_size else {}
    return qarray.HowToQuantize(
        qtype=qtype,
        channelwise_axes=(0,) if for_lhs else (0, 2),
        tiled_axes=tiled,
        calibration_method=calibration_method,
    )


def ragged_dot(lhs, rhs, group_sizes, *args, **kwargs) -> jax.Array:
    """jax.lax.ragged_dot on QArrays, computed on the dequantized values.

    A rhs scale varies by group, i.e. by the row of the output, so it can't be applied after an
    integer matmul as one broadcast; the weight is stored quantized and dequantized here.
    """
    lhs, rhs = (qarray.dequantize(x) if isinstance(x, qarray.QArray) else x for x in (lhs, rhs))
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, *args, **kwargs)


# ---- gradient layouts (for the quantized backward pass of QT) -----------------------------------


@dataclasses.dataclass(frozen=True)
class GradLayout:
    """Axes of an op's output gradient g, by the operand they come from.

    ``batch`` axes come from both operands; ``lhs_free`` / ``rhs_free`` from one only. The gradient
    of the lhs contracts g over ``rhs_free`` (so g gets a scale per index of batch + lhs_free),
    and the gradient of the rhs contracts it over ``lhs_free``.
    """

    batch: tuple[int, ...]
    lhs_free: tuple[int, ...]
    rhs_free: tuple[int, ...]


def dot_general_grad_layout(dimension_numbers, ndims) -> GradLayout:
    (lc, rc), (lb, rb) = dimension_numbers
    n_lhs_free = ndims[0] - len(lc) - len(lb)
    n_rhs_free = ndims[1] - len(rc) - len(rb)
    nb = len(lb)
    return GradLayout(
        batch=tuple(range(nb)),
        lhs_free=tuple(range(nb, nb + n_lhs_free)),
        rhs_free=tuple(range(nb + n_lhs_free, nb + n_lhs_free + n_rhs_free)),
    )


def einsum_grad_layout(einsum_str: str) -> GradLayout | None:
    """The layout of a two-operand einsum's output; None for forms we don't parse ("...")."""
    spec = einsum_str.replace(" ", "")
    if "->" not in spec or "." in spec:
        return None
    ins, out = spec.split("->")
    if ins.count(",") != 1:
        return None
    lhs, rhs = ins.split(",")
    where = lambda keep: tuple(i for i, c in enumerate(out) if keep(c))  # noqa: E731
    return GradLayout(
        batch=where(lambda c: c in lhs and c in rhs),
        lhs_free=where(lambda c: c in lhs and c not in rhs),
        rhs_free=where(lambda c: c in rhs and c not in lhs),
    )


def conv_grad_layout(dn: jax.lax.ConvDimensionNumbers) -> GradLayout:
    """Output (N, C, spatial...): N and the spatial axes come from lhs, C from rhs."""
    n, c, *spatial = dn.out_spec
    return GradLayout(batch=(), lhs_free=(n, *spatial), rhs_free=(c,))


RAGGED_DOT_GRAD_LAYOUT = GradLayout(batch=(), lhs_free=(0,), rhs_free=(1,))
