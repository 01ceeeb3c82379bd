"""Calibrated methods on the model-free path: one checkpoint tensor at a time, as QuantizeParams
streams it, with the statistics a calibration collected for it.

A calibration made by a method's program holds, for a weight at path P, the statistic
`P<suffix>` (`_gptq`: the input Hessian; `_qep`: the Hessian of the partly quantized model's
inputs and their error's correlation, as qep.quantize gathers them; `_awq`: mean input
magnitudes; `_sq`: smoothing scales),
averaged as engine/core/averaging.py keeps them. `method_stats` finds them; `quantize_leaf`
quantizes P with its method, on the tensor's LeafPlan (qtype, channel axes, group size), and
returns the same LeafResult (codes, scales, quality) as modelfree.leaf.quantize_leaf, so every
writer and the wire take it. GPTQ and QEP give ordinary codes and scales. AWQ and SmoothQuant
params also carry a per-channel scale along the contracted axis, the reference's `awq_scale` /
`inv_sq_scale` (contrib/awq.py, contrib/smooth_quant.py): it travels as LeafResult.beside under
that name, and the writers store it at P/<name>, beside P/array, where the reference's param
tree has it. Each method computes exactly what its quantize_params computes for the weight
(the same functions, called the same way), so the parts are the model path's bits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.contrib import awq_core, calibration, gptq_core, gptq_host, qep_core
from qmill.engine.core import averaging, qarray, qcodes, qtypes
from qmill.engine.modelfree import layout, packing, recipes
from qmill.engine.modelfree import leaf as leaf_lib

SUFFIXES = {"_gptq": "gptq", "_qep": "qep", "_awq": "awq", "_sq": "smoothquant"}
SERVED = ("gptq", "qep", "awq", "smoothquant")
# The per-channel part each method stores beside the QArray, as the reference's param tree
# names it (WithAwqScale.awq_scale, WithSqScale.inv_sq_scale).
BESIDE = {"awq": "awq_scale", "smoothquant": "inv_sq_scale"}
# How messages name each method.
NAMES = {"gptq": "GPTQ", "qep": "QEP", "awq": "AWQ", "smoothquant": "SmoothQuant"}


def method_of(stat_path: str) -> str | None:
    """The method whose statistic lives at `stat_path` (`<param path><suffix>`), or None."""
    for suffix, method in SUFFIXES.items():
        if stat_path.endswith(suffix):
            return method
    return None


def method_stats(flat_stats: Mapping[str, Any]) -> dict[str, tuple[str, dict[str, np.ndarray]]]:
    """{param path: (method, its statistic {count, sum_of_...})} from '/'-joined flat stats."""
    grouped: dict[str, dict[str, np.ndarray]] = {}
    for path, value in flat_stats.items():
        stat, _, key = path.rpartition("/")
        if method_of(stat) is not None:
            grouped.setdefault(stat, {})[key] = np.asarray(value)
    out = {}
    for stat, value in grouped.items():
        method = method_of(stat)
        suffix = next(s for s, m in SUFFIXES.items() if m == method)
        out[stat.removesuffix(suffix)] = (method, value)
    return out


def _contracting_axis(plan: layout.LeafPlan, ndim: int, method: str) -> int:
    axes = sorted(set(range(ndim)) - set(plan.channelwise_axes))
    if len(axes) != 1:
        raise ValueError(
            f"{plan.path}: {NAMES[method]} needs exactly one contracted axis, the plan has "
            f"{axes}; quantize this path without the calibration (skip it in the method's rules)"
        )
    return axes[0]


def _normalized_how(plan: layout.LeafPlan, axis: int) -> qarray.HowToQuantize:
    """The plan's HowToQuantize for its weight as (rows, columns) with the contracted `axis`
    last: rows channelwise, columns tiled as the plan tiles that axis."""
    tile = dict(plan.tiled_axes).get(axis)
    return qarray.HowToQuantize(
        qtype=plan.qtype,
        channelwise_axes=(0,),
        tiled_axes={1: tile} if tile else {},
        calibration_method=plan.calibration_method,
    )


def quantize_leaf(
    array: np.ndarray | jax.Array,
    plan: layout.LeafPlan,
    method: str,
    stat: Mapping[str, np.ndarray],
    *,
    blocksize: int = 128,
    percdamp: float = 0.01,
    n_grid: int = 20,
) -> leaf_lib.LeafResult:
    """Quantizes one tensor by `method` with its averaged statistic (see the module docstring).

    blocksize, percdamp: GPTQ's (gptq.quantize_params' defaults; QEP's GPTQ step too, its
    correction as qep.quantize_params' defaults); n_grid: AWQ's (AwqRule's).

    Raises:
      ValueError: an unknown method, statistics that don't fit the tensor, or a tensor without
        exactly one contracted axis.
    """
    if method not in SERVED:
        raise ValueError(f"{plan.path}: unknown calibrated method {method!r}; one of {SERVED}")
    if int(stat["count"]) == 0:
        raise ValueError(f"{plan.path}: its {method} statistics hold no batches (count 0)")
    x = jax.numpy.asarray(array)
    axis = _contracting_axis(plan, x.ndim, method)
    # The weight as the model path's CalibratedQuantContext has it: (rows, columns), the
    # contracted axis last, rows channelwise and columns tiled as the plan tiles that axis.
    w, restore = calibration.normalize_weight(x, axis)
    averaged = averaging.calibration({k: jax.numpy.asarray(v) for k, v in stat.items()})
    how = _normalized_how(plan, axis)
    key = {"awq": "act_scale", "smoothquant": "sq_scale"}.get(method, "hessian")
    want = (w.shape[1],) * (2 if key == "hessian" else 1)
    if averaged[key].shape != want:
        raise ValueError(
            f"{plan.path}: {NAMES[method]} statistics of shape {averaged[key].shape} do not "
            f"match the tensor's {w.shape[1]} input features (axis {axis}); was the calibration "
            "made for this model?"
        )
    beside, outputs = {}, {}
    if key == "hessian":
        # QEP first moves the weight for its inputs' error, as qep.quantize_params does.
        moved = _qep_corrected(w, averaged, plan) if method == "qep" else w
        # gptq_core compiles quantize_weight as one function: the model path's bits.
        q, _ = gptq_core.quantize_weight(
            moved, averaged[key], how, blocksize=blocksize, percdamp=percdamp
        )
        deq = qarray.dequantize(restore(q))
        # What GPTQ minimises, beside round to nearest's on the same inputs: the report shows
        # both, as the weight's SQNR alone reads as a regression (it is not what GPTQ lowers).
        outputs = {
            "output_sqnr_db": _output_sqnr(w, qarray.dequantize(q), averaged[key]),
            "rtn_output_sqnr_db": _output_sqnr(
                w, qarray.dequantize(qarray.quantize(w, how)), averaged[key]
            ),
        }
    elif method == "awq":
        # As awq.quantize_params: eagerly, op by op, as the model path runs it.
        q, scales = awq_core.quantize_weight(w, averaged[key], how, n_grid=n_grid)
        beside[BESIDE[method]] = scales.reshape(-1)
        deq = restore(qarray.dequantize(q) / scales)  # the weight it stands for
    else:
        # As smooth_quant.quantize_params: Q(W · s), and 1/s averaged on its own beside it;
        # inference multiplies the activation by it, i.e. the weight it stands for is Q · 1/s.
        q = qarray.quantize(w * averaged[key], how)
        beside[BESIDE[method]] = averaged["inv_sq_scale"]
        deq = restore(qarray.dequantize(q) * averaged["inv_sq_scale"])
    return _result(x, restore(q), plan, deq, beside, outputs)


def _qep_corrected(w: jax.Array, averaged: Mapping[str, jax.Array], plan: layout.LeafPlan):
    if "hessian_delta" not in averaged:
        raise ValueError(
            f"{plan.path}: its QEP statistics have no hessian_delta (the correlation of the "
            "inputs' error); gather them with qep.quantize"
        )
    return qep_core.weight_correct(w, averaged["hessian"], averaged["hessian_delta"])


@jax.jit
def _output_energies(w: jax.Array, w_hat: jax.Array, hessian: jax.Array) -> tuple[Any, Any]:
    w = w.astype(jnp.float32)
    e = w - w_hat.astype(jnp.float32)
    h = hessian.astype(jnp.float32)
    return jnp.sum((w @ h) * w), jnp.sum((e @ h) * e)


def _output_sqnr(w: jax.Array, w_hat: jax.Array, hessian: jax.Array) -> float:
    """10·log10(tr(W H Wᵀ) / tr(E H Eᵀ)), E = W − Ŵ: the SQNR of the layer's output x·Wᵀ over
    inputs x whose second moments are H (weights as (rows, inputs))."""
    signal, noise = _output_energies(w, w_hat, hessian)
    return leaf_lib.quality(float(signal), float(noise), 1.0, 1.0).sqnr_db


def _result(
    x: jax.Array,
    q: qarray.QArray,
    plan: layout.LeafPlan,
    deq: jax.Array,
    beside: dict[str, jax.Array],
    outputs: dict[str, float] | None = None,
) -> leaf_lib.LeafResult:
    """The LeafResult of `q` (in the tensor's layout), measured against `deq`, the float weight
    it stands for."""
    scale = q.scale if plan.scale_dtype is None else q.scale.astype(plan.scale_dtype)
    qvalue, packed_as = np.asarray(q.qvalue), None
    storage = np.dtype(qtypes.get(plan.qtype).storage)
    if qcodes.byte_dtype(plan.qtype) != storage:  # 4-bit: packed as the plain path packs them
        qvalue = np.asarray(packing.pack_nibbles(q.qvalue.astype(jnp.int8).reshape(-1)))
        packed_as = (storage, tuple(x.shape))
    return leaf_lib.LeafResult(
        qvalue=qvalue,
        scale=np.asarray(scale),
        zero_point=None if q.zero_point is None else np.asarray(q.zero_point),
        quality=dataclasses.replace(
            leaf_lib.measure(np.asarray(x, np.float32), np.asarray(deq, np.float32)),
            **(outputs or {}),
        ),
        packed_as=packed_as,
        beside={name: np.asarray(v) for name, v in beside.items()},
    )


def quantizer(stats: Mapping[str, tuple[str, Mapping[str, np.ndarray]]]):
    """A quantize(array, plan) for the streaming path: the method where `stats` has the
    tensor's path (a checkpoint's leading "params/" level aside, as the params of a model have
    none), plain modelfree.leaf.quantize_leaf elsewhere."""

    def quantize(array: Any, plan: layout.LeafPlan) -> leaf_lib.LeafResult:
        found = stats.get(plan.path) or stats.get(plan.path.removeprefix("params/"))
        if found is None:
            return leaf_lib.quantize_leaf(array, plan)
        return quantize_leaf(array, plan, *found)

    return quantize


def gptq_refusal(rule: recipes.TensorRule) -> str | None:
    """Why GPTQ cannot quantize what a recipe's quantizing `rule` asks for, or None when it can:
    its group scales are plain floats found from the weight, one per group of input features.

    A micro-scaled qtype (MXFP4, MXFP8: each group's scale a power of two, E8M0; NVFP4: E4M3
    under a per-tensor global scale) stores a quantized scale GPTQ would have to round with the
    codes, and blocks tiled along both axes (FP8_BLOCK's 128 × 128) group output rows too.
    """
    qt = qtypes.get(rule.qtype)
    if qt.required_tile is not None:
        if qt.scale_rounding == qtypes.POW2:
            stored = "rounds each group's scale to a power of two (E8M0)"
        else:
            stored = "stores each group's scale in E4M3 under a per-tensor global scale"
        return f"{qt.name} {stored}, which qmill's GPTQ does not do yet"
    if rule.tiled_axes is not None and len(rule.tiled_axes) > 1:
        return (
            "its blocks tile both axes of a weight, and GPTQ's groups run along the input "
            "features only"
        )
    return None


def gptq_static_leaves(
    arrays: Sequence[np.ndarray | jax.Array],
    plans: Sequence[layout.LeafPlan],
    hessian: jax.Array,
    options: gptq_core.GptqOptions,
) -> list[tuple[leaf_lib.LeafResult, jax.Array, float]]:
    """GPTQ with static group scales (gptq_core.GptqOptions) of tensors that take one input
    (whose Hessian is `hessian`), each on its LeafPlan.

    For a caller that feeds the quantized weights onward (a language model calibrated layer by
    layer): returns per tensor (the LeafResult every writer takes; the weight the codes stand
    for, in the tensor's layout and float32; GPTQ's loss, Σ (w − ŵ)² / (2 Hinv_ii²)). Integer
    codes of one qtype and tiling go through one host loop (gptq_host); others one by one.

    Raises:
      ValueError: a Hessian that doesn't fit a tensor, or a tensor without exactly one
        contracted axis.
    """
    prepared = []
    for array, plan in zip(arrays, plans, strict=True):
        x = jax.numpy.asarray(array)
        axis = _contracting_axis(plan, x.ndim, "gptq")
        w, restore = calibration.normalize_weight(x, axis)
        if hessian.shape != (w.shape[1],) * 2:
            raise ValueError(
                f"{plan.path}: a Hessian of shape {hessian.shape} does not fit the tensor's "
                f"{w.shape[1]} input features (axis {axis})"
            )
        how = _normalized_how(plan, axis)
        prepared.append((x, w, restore, how))
    hows = {how for *_, how in prepared}
    if len(hows) == 1 and gptq_host.supports(next(iter(hows))):
        quantized = gptq_host.quantize_shared_input(
            [w for _, w, _, _ in prepared], hessian, prepared[0][3], options
        )
    else:
        quantized = [
            gptq_core.quantize_weight_static(w, hessian, how, options) for _, w, _, how in prepared
        ]
    out = []
    for (x, _, restore, _), plan, (q, losses) in zip(prepared, plans, quantized, strict=True):
        q = restore(q)
        deq = qarray.dequantize(q).astype(jnp.float32)
        out.append((_result(x, q, plan, deq, {}), deq, float(np.sum(losses))))
    return out
