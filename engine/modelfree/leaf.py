"""Quantizes one checkpoint tensor as a LeafPlan says, and measures how faithful the result is.

This is the service's unit of work: the server and the client's embedded mode both call
`quantize_leaf`, so their outputs are the same bits. Compiled functions are cached per (shape,
dtype, plan): a checkpoint of many same-shaped tensors compiles once per shape.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.core import qarray_parts, qcodes, qtypes
from qmill.engine.modelfree import layout, packing


@dataclasses.dataclass(frozen=True)
class Quality:
    # 10·log10(Σx² / Σ(x − x̂)²); +inf when the round trip is exact, −inf for noise on a zero signal.
    sqnr_db: float
    # mean|x − x̂| / mean|x|; 0 when the round trip is exact, +inf for noise on a zero signal.
    mean_relative_error: float
    # A calibrated method's own measure, where its statistics give it (GPTQ: the layer's output
    # on the calibration inputs, 10·log10(tr(W H Wᵀ) / tr(E H Eᵀ)), E = W − Ŵ, H their second
    # moments); NaN otherwise. rtn_output_sqnr_db: the same for round to nearest, for comparison.
    output_sqnr_db: float = math.nan
    rtn_output_sqnr_db: float = math.nan


def quality(signal: float, noise: float, abs_x: float, abs_err: float) -> Quality:
    """The one quality record of a round trip x -> x̂, from Σx², Σ(x − x̂)², mean|x|, mean|x − x̂|.

    Defined for every input: no noise is an exact round trip (+inf dB, relative error 0), whatever
    the signal; noise on a zero signal is −inf dB and relative error +inf.
    """
    sqnr = math.inf if noise == 0 else 10 * math.log10(signal / noise) if signal else -math.inf
    mre = 0.0 if abs_err == 0 else abs_err / abs_x if abs_x else math.inf
    return Quality(sqnr_db=sqnr, mean_relative_error=mre)


def measure(x: np.ndarray, xhat: np.ndarray) -> Quality:
    """`quality` of two float32 host arrays of the same shape (x the original)."""
    err = x - xhat
    return quality(
        float(np.sum(x**2)),
        float(np.sum(err**2)),
        float(np.mean(np.abs(x))),
        float(np.mean(np.abs(err))),
    )


@dataclasses.dataclass(frozen=True)
class LeafResult:
    """Host (numpy) parts of a quantized tensor, ready to be written or sent."""

    # The codes; 4-bit ones packed as checkpoints and the wire store them (two per byte, low
    # nibble first, flat uint8), `packed_as` then gives the dtype and shape they stand for.
    qvalue: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None
    quality: Quality
    packed_as: tuple[np.dtype, tuple[int, ...]] | None = None
    # Per-channel parts a calibrated method stores beside the QArray, under the reference's
    # param names (AWQ's "awq_scale", SmoothQuant's "inv_sq_scale"; contrib/leaf.py): written
    # at P/<name>, beside P/array. Empty for every other method.
    beside: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def codes(self) -> np.ndarray:
        """The codes as an array of their dtype and shape (unpacked: a copy when packed)."""
        if self.packed_as is None:
            return self.qvalue
        return packing.unpack_nibbles(self.qvalue, *self.packed_as)


def how_to_quantize(plan: layout.LeafPlan) -> qarray_parts.HowToQuantize:
    """The plan's HowToQuantize: its qtype, axes, tiles, calibration, arithmetic and global
    scale (also AWQ's fake quantization, engine/lm/awq.py, so that it rounds as the writer)."""
    return qarray_parts.HowToQuantize(
        qtype=plan.qtype,
        channelwise_axes=plan.channelwise_axes,
        tiled_axes=dict(plan.tiled_axes),
        calibration_method=plan.calibration_method,
        arithmetic=plan.arithmetic,
        global_scale=plan.global_scale,
    )


# The quality pass dequantizes and sums on about this many values of a tensor, not all of them:
# on the CPU XLA materializes the f32 error before reducing it, so measuring a whole tensor took
# ~10x the quantization itself (bench/README.md). The sample is whole scale blocks, evenly spread.
QUALITY_SAMPLE = 1 << 20


def quality_stride(shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> tuple[int, int]:
    """(axis, stride): the quality pass measures every stride-th block of scales along axis.

    The axis with the most scale blocks (the first of equals), so strides cut evenly; stride 1
    (the whole tensor) for tensors of fewer than 2 * QUALITY_SAMPLE values.
    """
    if not shape:
        return 0, 1
    axis = max(range(len(shape)), key=lambda a: (scale_shape[a], -a))
    size = math.prod(shape)
    return axis, max(1, min(scale_shape[axis], size // QUALITY_SAMPLE))


def _every(a: jax.Array, axis: int, blocks: int, stride: int) -> jax.Array:
    """Every stride-th of `blocks` equal blocks of `a` along `axis`, joined again."""
    if stride == 1:
        return a
    tile = a.shape[axis] // blocks
    split = a.reshape((*a.shape[:axis], blocks, tile, *a.shape[axis + 1 :]))
    taken = jax.lax.slice_in_dim(split, 0, blocks, stride, axis)
    return taken.reshape((*a.shape[:axis], -1, *a.shape[axis + 1 :]))


def _quality_sums(x, codes, scale, zero_point, qtype: str, axis: int, stride: int):
    """Σx², Σ(x − x̂)², mean|x|, mean|x − x̂| over every stride-th scale block along axis."""
    blocks = scale.shape[axis] if scale.ndim else 1
    x, codes = (_every(a, axis, blocks, stride) for a in (x, codes))
    if stride > 1:
        scale = jax.lax.slice_in_dim(scale, 0, blocks, stride, axis)
        if zero_point is not None:
            zero_point = jax.lax.slice_in_dim(zero_point, 0, blocks, stride, axis)
    x32 = x.astype(jnp.float32)
    deq = qarray_parts.dequantize_bytes(codes, qtype, scale, zero_point)
    err = deq.astype(jnp.float32) - x32
    return (
        jnp.sum(x32 * x32),
        jnp.sum(err * err),
        jnp.mean(jnp.abs(x32)),
        jnp.mean(jnp.abs(err)),
    )


# Static arguments are the compile cache key: `how`, the scale dtype and the quality sample (a
# function of the shape), never the plan, whose path differs for every tensor (jit adds shape and
# dtype of x itself).
@functools.partial(jax.jit, static_argnames=("how", "scale_dtype", "axis", "stride"))
def _quantize_and_measure(
    x: jax.Array,
    how: qarray_parts.HowToQuantize,
    scale_dtype: str | None,
    axis: int,
    stride: int,
    global_scale: jax.Array | None = None,
):
    # 4-bit codes come as bytes (qarray_parts.quantize_bytes) and leave packed two per byte, as
    # they are stored: packing fuses with the quantizing loop, where XLA:CPU writes int4/uint4
    # arrays element by element and numpy on the host took ~20 % of a whole int4 checkpoint run.
    codes, scale, zero_point = qarray_parts.quantize_bytes(
        x, how, scale_dtype=scale_dtype, global_scale=global_scale
    )
    # A global scale divides the stored (E4M3) scale: the values are codes × scale / global.
    value_scale = scale
    if global_scale is not None:
        value_scale = scale.astype(jnp.float32) / global_scale
    sums = _quality_sums(x, codes, value_scale, zero_point, how.qtype, axis, stride)
    if _packs(how.qtype):
        codes = packing.pack_nibbles(codes.reshape(-1))
    return (codes, scale, zero_point), *sums


def _packs(qtype: str) -> bool:
    """Whether codes of `qtype` are 4-bit, stored two per byte."""
    return qcodes.byte_dtype(qtype) != np.dtype(qtypes.get(qtype).storage)


# PJRT:CPU uses a host buffer in place when it is aligned to this many bytes, else copies it.
_CPU_ALIGNMENT = 64


def _on_device(array: np.ndarray | jax.Array) -> jax.Array:
    """`array` as a jax array on the default device, without a copy where possible.

    jnp.asarray always copies. On CPU, device_put uses the numpy buffer in place when it is
    64-byte aligned; numpy's own large arrays are 16-byte aligned, and PJRT's fallback copy ran
    at ~1.5 GB/s here, 3x slower than copying into an aligned buffer with numpy first.
    """
    if isinstance(array, jax.Array):
        return array
    array = np.asarray(array)
    if jax.default_backend() == "cpu" and (
        array.ctypes.data % _CPU_ALIGNMENT or not array.flags.c_contiguous
    ):
        raw = np.empty(array.nbytes + _CPU_ALIGNMENT, np.uint8)
        start = -raw.ctypes.data % _CPU_ALIGNMENT
        aligned = raw[start : start + array.nbytes].view(array.dtype).reshape(array.shape)
        np.copyto(aligned, array)
        array = aligned
    return jax.device_put(array)


# Host tensors of at most this many values are checked for NaN/Inf by numpy (<= 0.1 ms for
# 2^16 bfloat16 values here), not by a jit compiled for their shape (~40 ms of CPU each, the
# price of each distinct small shape in a checkpoint: a quarter of the quick start's compiling).
HOST_CHECK_MAX = 1 << 16


def _all_finite(array: np.ndarray | jax.Array, x: jax.Array) -> bool | jax.Array:
    """Whether the tensor (`array`, on the device as `x`) has no NaN/Inf.

    Large ones are checked on the device, in their own jit: fused with the quantization, XLA
    wrote a whole f32 copy of a bf16 tensor for it. The answer is read only after the
    quantization is dispatched.
    """
    if not isinstance(array, jax.Array) and x.size <= HOST_CHECK_MAX:
        return bool(np.isfinite(np.asarray(array)).all())
    return qarray_parts.all_finite(x)


def quantize_leaf(array: np.ndarray | jax.Array, plan: layout.LeafPlan) -> LeafResult:
    """Quantizes `array` as `plan` says (plan.quantize must be true).

    A host `array` is no longer referenced by jax once this returns (it waits, within a bound,
    for jaxlib to let go: _await_release): the caller's buffer is free (or reusable) as soon as
    the caller drops it.

    Raises:
      ValueError: NaN/Inf in the tensor, or a plan the engine refuses (bad qtype, tile, method).
    """
    owner = _owner(array)
    # As _await_release will count them: one more, its own parameter.
    refs = sys.getrefcount(owner) + 1 if owner is not None else 0
    try:
        return _quantize_leaf(array, plan)
    finally:
        release_host_buffers()
        if owner is not None:
            _await_release(owner, refs)


# How long quantize_leaf waits for jaxlib to let go of a host buffer it used in place: the
# release takes ~1 ms when it is late; the bound only keeps a buffer another thread also refers
# to (a shared owner) from stalling every tensor.
_RELEASE_WAIT_S = 0.25


def _owner(array: Any) -> Any:
    """The object that owns a numpy array's memory (numpy keeps views' bases flat), or None."""
    if not isinstance(array, np.ndarray):
        return None
    return array.base if array.base is not None else array


def _await_release(owner: Any, refs: int) -> None:
    """Waits (bounded) until jaxlib has let go of `owner`, counted `refs` before jax saw it.

    jaxlib's CPU client lets go of an input's buffer from its own thread once the computations
    using it are done, which can come after their results: ~1.2 ms later in ~12 % of calls on
    the dev VM, after the collection above. The buffer then looked in use to its pool (the
    server's assembly buffers, wire._Buffers) and a test of this (leaf_test) failed now and
    then."""
    deadline = time.monotonic() + _RELEASE_WAIT_S
    while sys.getrefcount(owner) > refs and time.monotonic() < deadline:
        time.sleep(0.0002)
        release_host_buffers()


def release_host_buffers() -> None:
    """Drops the references jaxlib still holds to host buffers of deleted arrays.

    device_put uses an aligned numpy buffer in place (_on_device); when the jax array is deleted,
    jaxlib queues its reference to the numpy array and drops it at its next garbage collection
    (jax._src.lib registers that as a gc callback), not at once. Until then the buffer stays
    alive: the server's next tensor found its kept assembly buffer still referenced and
    allocated a third and fourth 64 MiB one (bench/README.md, issue 27). A generation-0
    collection runs the callback (~0.05 ms).
    """
    gc.collect(0)


def _quantize_leaf(array: np.ndarray | jax.Array, plan: layout.LeafPlan) -> LeafResult:
    if not plan.quantize:
        raise ValueError(f"{plan.path}: the plan keeps this tensor ({plan.reason})")
    x = _on_device(array)
    how = how_to_quantize(plan)
    # An NVFP4 global scale is an argument, not part of the compile key (how): in `how`, each
    # tensor of a checkpoint, whose global scale is its own, compiled anew.
    global_scale = None
    if how.global_scale is not None:
        global_scale = np.float32(how.global_scale)
        how = dataclasses.replace(how, global_scale=1.0)
    # The scale's shape, without tracing (jax.eval_shape costs ~4 ms): one per tile.
    scale_shape = tuple(n // t for n, t in zip(x.shape, how.tiles(x.shape), strict=True))
    axis, stride = quality_stride(x.shape, scale_shape)
    finite = _all_finite(array, x)
    outputs = jax.device_get(
        _quantize_and_measure(x, how, plan.scale_dtype, axis, stride, global_scale)
    )
    q, signal, noise, abs_x, abs_err = outputs
    if not finite:
        raise ValueError(
            f"{plan.path}: tensor contains NaN or Inf; quantization would spread them over whole "
            "scale blocks. Fix the checkpoint or skip this path with a rule"
        )
    codes, scale, zero_point = q
    _check_scales(plan, np.asarray(scale), zero_point)
    packed_as = None
    if _packs(plan.qtype):
        packed_as = (np.dtype(qtypes.get(plan.qtype).storage), tuple(x.shape))
    return LeafResult(
        qvalue=np.asarray(codes),
        scale=np.asarray(scale),
        zero_point=None if zero_point is None else np.asarray(zero_point),
        quality=quality(*(float(v) for v in (signal, noise, abs_x, abs_err))),
        packed_as=packed_as,
    )


def _check_scales(plan: layout.LeafPlan, scale: np.ndarray, zero_point: np.ndarray | None) -> None:
    """A scale that is not finite and positive is an error, never an output: whatever the cause
    (a scale_dtype too narrow for the tensor's range, a calibration past float32), it writes
    all-NaN or all-zero values that dequantize to garbage. Scales are one per block, so checking
    them on the host costs nothing next to the tensor."""
    scale32 = scale.astype(np.float32)
    bad = ~(np.isfinite(scale32) & (scale32 > 0))
    zero_bad = zero_point is not None and not np.isfinite(np.asarray(zero_point, np.float32)).all()
    if not bad.any() and not zero_bad:
        return
    example = scale32[bad][0] if bad.any() else "a non-finite zero point"
    if plan.scale_dtype is not None and np.dtype(plan.scale_dtype).itemsize < 4:
        fix = f"scale_dtype {plan.scale_dtype} cannot hold this tensor's scales: use float32"
    else:
        fix = (
            f"the tensor's range does not fit {plan.qtype} with calibration "
            f"{plan.calibration_method!r}: use another calibration_method, or skip this path "
            "with a rule"
        )
    raise ValueError(
        f"{plan.path}: quantizing gave {int(bad.sum())} of {scale32.size} scales that are not "
        f"finite and positive (e.g. {example}); {fix}"
    )
