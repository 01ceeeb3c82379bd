"""Calibrated methods on the model-free path: one checkpoint tensor at a time, as QuantizeParams
streams it, with the statistics a calibration collected for it.

A calibration made by a method's program holds, for a weight at path P, the statistic
`P<suffix>` (`_gptq`: the input Hessian; `_awq`: mean input magnitudes; `_sq`: smoothing scales),
averaged as engine/core/averaging.py keeps them. `method_stats` finds them; `quantize_leaf`
quantizes P with its method, on the tensor's LeafPlan (qtype, channel axes, group size), and
returns the same LeafResult (codes, scales, quality) as modelfree.leaf.quantize_leaf, so every
writer and the wire take it. Only GPTQ is served here: its output is ordinary codes and scales.
AWQ and SmoothQuant params carry a per-channel scale no checkpoint format of the service holds
yet, so they are refused with that reason (their statistics are collected all the same, and
awq.quantize_params / smooth_quant.quantize_params apply them in-process).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.contrib import calibration, gptq_core
from qmill.engine.core import averaging, numerics, qarray, qtypes
from qmill.engine.modelfree import layout, packing
from qmill.engine.modelfree import leaf as leaf_lib

SUFFIXES = {"_gptq": "gptq", "_awq": "awq", "_sq": "smoothquant"}
SERVED = ("gptq",)


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


def _contracting_axis(plan: layout.LeafPlan, ndim: int) -> int:
    axes = sorted(set(range(ndim)) - set(plan.channelwise_axes))
    if len(axes) != 1:
        raise ValueError(
            f"{plan.path}: GPTQ needs exactly one contracted axis, the plan has {axes}; quantize "
            "this path without the calibration (skip it in the method's rules)"
        )
    return axes[0]


def quantize_leaf(
    array: np.ndarray | jax.Array,
    plan: layout.LeafPlan,
    method: str,
    stat: Mapping[str, np.ndarray],
    *,
    blocksize: int = 128,
    percdamp: float = 0.01,
) -> leaf_lib.LeafResult:
    """Quantizes one tensor by `method` with its averaged statistic (see the module docstring).

    Raises:
      ValueError: a method the service cannot write, statistics that don't fit the tensor, or a
        tensor without exactly one contracted axis.
    """
    if method not in SERVED:
        raise ValueError(
            f"{plan.path}: {method} params carry a per-channel scale beside the codes "
            "(the reference's awq_scale / inv_sq_scale), which the service's checkpoint formats "
            f"cannot hold; apply {method} in-process (qmill.engine.contrib) or use gptq"
        )
    if int(stat["count"]) == 0:
        raise ValueError(f"{plan.path}: its {method} statistics hold no batches (count 0)")
    x = jax.numpy.asarray(array)
    axis = _contracting_axis(plan, x.ndim)
    w, restore = calibration.normalize_weight(x, axis)
    hessian = averaging.calibration({k: jax.numpy.asarray(v) for k, v in stat.items()})["hessian"]
    if hessian.shape != (w.shape[1], w.shape[1]):
        raise ValueError(
            f"{plan.path}: GPTQ statistics of shape {hessian.shape} do not match the tensor's "
            f"{w.shape[1]} input features (axis {axis}); was the calibration made for this model?"
        )
    tile = dict(plan.tiled_axes).get(axis)
    how = qarray.HowToQuantize(
        qtype=plan.qtype,
        channelwise_axes=(0,),
        tiled_axes={1: tile} if tile else {},
        calibration_method=plan.calibration_method,
    )
    # gptq_core compiles quantize_weight as one function: the model path's bits, not just close.
    q, _ = gptq_core.quantize_weight(w, hessian, how, blocksize=blocksize, percdamp=percdamp)
    q = restore(q)
    scale = q.scale if plan.scale_dtype is None else q.scale.astype(plan.scale_dtype)
    host = np.asarray(x, np.float32)
    deq = np.asarray(qarray.dequantize(q), np.float32)
    qvalue, packed_as = np.asarray(q.qvalue), None
    storage = np.dtype(qtypes.get(plan.qtype).storage)
    if numerics.byte_dtype(plan.qtype) != storage:  # 4-bit: packed as the plain path packs them
        qvalue = np.asarray(packing.pack_nibbles(q.qvalue.astype(jnp.int8).reshape(-1)))
        packed_as = (storage, tuple(x.shape))
    return leaf_lib.LeafResult(
        qvalue=qvalue,
        scale=np.asarray(scale),
        zero_point=None if q.zero_point is None else np.asarray(q.zero_point),
        quality=leaf_lib.measure(host, deq),
        packed_as=packed_as,
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
