"""Arithmetic of quantization: scales, zero points, and converting values to and from a qtype.

Lingo:
  x        the real (float) array being quantized.
  scale    per-tile multiplier: x ≈ (q − zero_point) · scale.
  y        x / scale (+ zero_point) (+ noise): x in units of the qtype, before conversion.
  q        the stored code (qvalue): an integer, a narrow float, or an nf4 index.
  levels   the real value of each nf4 code.

docs/numerics-spec.md fixes every step (the reference is bit for bit); comments below say which
rule a line implements where the reason is not obvious.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from qmill.engine.core import qcodes, qtypes

# The reference's public helpers (bounds, conversions); see numerics_api.py.
from qmill.engine.core.numerics_api import can_dequant_on_output as can_dequant_on_output
from qmill.engine.core.numerics_api import convert_from as convert_from
from qmill.engine.core.numerics_api import get_asymmetric_bound as get_asymmetric_bound
from qmill.engine.core.numerics_api import get_nf4_buckets as get_nf4_buckets
from qmill.engine.core.numerics_api import get_symmetric_bound as get_symmetric_bound
from qmill.engine.core.numerics_api import should_quantize as should_quantize

# (exponent bits, mantissa bits) of the float formats computed in float32 and rounded back.
_NARROW = {np.dtype(jnp.bfloat16): (8, 7), np.dtype(jnp.float16): (5, 10)}


# Exactness. The reference evaluates op by op; each op is its own small XLA computation, whose
# result we must reproduce inside one big jit, where XLA would otherwise rewrite differently:
#   - bf16 ops run in float32 and are rounded to bf16 once per op ("excess precision" inside a
#     jit would skip that rounding); f16 ops are rounded to f16 per op, as are their constants.
#   - `a / b` with b broadcast (a scalar or lower-rank scale) compiles to `a * (1 / b)`, the
#     reciprocal in float32 (bf16, f32) or f16 (f16); with b of a's shape it is a true division.
# So narrow floats are carried in float32 and rounded back explicitly with reduce_precision
# (which XLA keeps), broadcast divisions are written as the reciprocal multiply they compile to,
# and true divisions get a divisor XLA can't see as a broadcast (`b + a * 0`, not foldable for
# floats). All of it stays inside the same fused elementwise loop.
#
# Off the CPU (the aim: the CPU's bits on every backend; the H200 runs of 2026-11-26/27 and their
# causes: docs/numerics.md, "On a GPU"). XLA:GPU lowers float32 division to `div.full.f32`
# (within 2 ulp, not correctly rounded) where XLA:CPU, on which the reference was measured,
# divides exactly. So on a GPU every array division and square root is done in float64 and
# rounded to float32 (`_correctly_rounded`): float64's are IEEE on every backend, and rounding a
# float64 quotient or root of float32 operands to float32 gives the correctly rounded float32
# result (double rounding is innocuous for ÷ and √ since 53 ≥ 2·24 + 2). LLVM knows that bound
# too and folds such a division back to float32 when its operands are plain extensions, so they
# are assembled from bits (`_float64_of`). These are per-scale ops (a reciprocal per channel or
# tile), not per-element, except degenerate one-element tiles. On the CPU they stay in float32:
# XLA:CPU fuses the float64→float32 convert into the elementwise loop, which made bf16 int8
# quantization ~45 % slower for no change in bits. The same switch spells out the CPU's order of
# a sum (`sum_as_cpu`); E4M3 rounding (`qcodes.round_e4m3`) is integer arithmetic everywhere.

# None: float64 ÷ and √ (and sums in the CPU's order) on GPUs only; True/False forces it
# (float64_arithmetic()).
_FLOAT64_ARITHMETIC: bool | None = None


@contextlib.contextmanager
def float64_arithmetic(enabled: bool | None) -> Iterator[None]:
    """Forces (or, with None, restores the default of) the GPU's route within the block:
    float64 ÷ and √, and sums in XLA:CPU's order (`sum_as_cpu`).

    For tests and diagnosis on the CPU. Jitted functions already traced keep their choice, so
    jax's caches are cleared on entry and exit. Not thread-safe: process-wide.
    """
    global _FLOAT64_ARITHMETIC
    saved, _FLOAT64_ARITHMETIC = _FLOAT64_ARITHMETIC, enabled
    jax.clear_caches()
    try:
        yield
    finally:
        _FLOAT64_ARITHMETIC = saved
        jax.clear_caches()


def _use_float64() -> bool:
    if _FLOAT64_ARITHMETIC is not None:
        return _FLOAT64_ARITHMETIC
    # TPUs are left out: whether XLA:TPU's f64 (emulated, if at all) is IEEE is not known here.
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def gpu_route() -> bool:
    """Whether ÷, √ and sums take the GPU's route in this process now (see above)."""
    return _use_float64()


def wide_dtype(dtype: jnp.dtype) -> np.dtype:
    """The dtype arithmetic on `dtype` values is carried out in."""
    return np.dtype(jnp.float32) if np.dtype(dtype) in _NARROW else np.dtype(dtype)


def widen(x: jax.Array) -> jax.Array:
    return x.astype(wide_dtype(x.dtype))


def fit(v: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Rounds a wide intermediate to `dtype`'s precision, keeping the wide dtype."""
    dtype = np.dtype(dtype)
    if dtype in _NARROW:
        return jax.lax.reduce_precision(v.astype(jnp.float32), *_NARROW[dtype])
    return v.astype(dtype)


def const(c: float, dtype: jnp.dtype) -> float:
    """A Python constant as an op on `dtype` sees it (weak typing rounds it to `dtype` first)."""
    return float(np.asarray(c, dtype=dtype).astype(np.float64))


def _float64_of(a: jax.Array) -> jax.Array:
    """float32 `a` as float64, assembled from its bits (call under jax.enable_x64).

    Not `a.astype(float64)`: LLVM's instcombine turns fptrunc(fdiv(fpext a, fpext b)) into a
    float32 fdiv (the same value where float32 division is IEEE, by the double-rounding bound
    above), and XLA:GPU lowers that to div.full.f32: the float64 route was silently an
    approximate float32 division again (H200, 2026-11-27: bench/results/h200-2026-11-27). A
    float64 made by integer ops is no fpext to LLVM, so the division stays float64.
    """
    bits = jax.lax.bitcast_convert_type(a.astype(jnp.float32), jnp.uint32)
    man = (bits & 0x7FFFFF).astype(jnp.uint64)
    exp = ((bits >> 23) & 0xFF).astype(jnp.uint64)
    sign = (bits >> 31).astype(jnp.uint64) << 63
    normal = ((exp + (1023 - 127)) << 52) | (man << 29)
    quiet = jnp.where(man == 0, np.uint64(0), np.uint64(1) << 51)  # a NaN made quiet, as a convert
    special = (np.uint64(0x7FF) << 52) | quiet | (man << 29)  # inf, NaN
    # Subnormal: man · 2^-149 with its leading one at bit p: 2^(p - 149) · 1.fraction.
    p = 31 - jax.lax.clz(bits & 0x7FFFFF).astype(jnp.uint64)
    fraction = (man - (np.uint64(1) << p)) << (52 - p)
    subnormal = jnp.where(man == 0, np.uint64(0), ((p + (1023 - 149)) << 52) | fraction)
    magnitude = jnp.where(exp == 0, subnormal, jnp.where(exp == 0xFF, special, normal))
    return jax.lax.bitcast_convert_type(sign | magnitude, jnp.float64)


def _correctly_rounded(op, *args: jax.Array) -> jax.Array:
    """op on wide float arrays, correctly rounded on every backend (see above), in their dtype."""
    dtype = jnp.result_type(*args)
    if np.dtype(dtype) != np.dtype(np.float32) or not _use_float64():
        return op(*args)
    with jax.enable_x64(True):
        return op(*(_float64_of(a) for a in args)).astype(jnp.float32)


def sqrt(v: jax.Array) -> jax.Array:
    """√v of a wide float array, correctly rounded on every backend."""
    return _correctly_rounded(jnp.sqrt, widen(v))


# XLA:CPU sums in a fixed order, and the reference's `rms` scales are its sums: its
# TreeReductionRewriter (run to a fixed point) cuts every reduced axis longer than 32 into
# windows of 32 (padded with zeros, the odd element high: XLA's "same" padding), sums each window
# element by element, and reduces the window sums the same way; 32 or fewer are summed element
# by element. XLA:GPU sums in a tree of its own. On the GPU route `sum_as_cpu` spells the CPU's
# order out. Measured equal to XLA:CPU (jax 0.10.2) for one reduced axis of any length, the rms
# case of a per-channel or one-axis-tiled scale; but XLA:CPU hands a sum whose input has 4096
# or more elements to YNNPACK, whose order depends on the CPU's vector width: there neither
# this nor another CPU can promise the bits (docs/numerics.md, "On a GPU").
_CPU_WINDOW = 32
# Windows longer than this are summed in a loop, not as one unrolled chain of adds.
_UNROLL = 64


def _sum_in_order(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """Sum over `axes` (kept, size 1), one element after another in row-major order from 0."""
    rest = [a for a in range(x.ndim) if a not in axes]
    moved = jnp.transpose(x, (*rest, *axes))
    flat = moved.reshape((*moved.shape[: len(rest)], -1))
    n = flat.shape[-1]
    acc = jnp.zeros(flat.shape[:-1], x.dtype)
    if n <= _UNROLL:
        for i in range(n):
            acc = acc + flat[..., i]
    else:
        acc = jax.lax.fori_loop(0, n, lambda i, a: a + flat[..., i], acc)
    shape = list(x.shape)
    for a in axes:
        shape[a] = 1
    return acc.reshape(shape)


def _cpu_sum(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """Sum over `axes` (kept) in XLA:CPU's order: windows of 32 while any axis is longer."""
    x = settle(x)  # a product feeding the adds stays rounded (no FMA), as the CPU's is
    while any(x.shape[a] > _CPU_WINDOW for a in axes):
        pads, split, windows = [], [], []
        for a, size in enumerate(x.shape):
            if a not in axes:
                pads.append((0, 0))
                split.append(size)
                continue
            w = min(size, _CPU_WINDOW)
            pad = -size % w
            pads.append((pad // 2, pad - pad // 2))
            split += [(size + pad) // w, w]
            windows.append(len(split) - 1)
        summed = _sum_in_order(jnp.pad(x, pads).reshape(split), tuple(windows))
        x = summed.reshape([n for i, n in enumerate(split) if i not in windows])
    return _sum_in_order(x, axes)


def sum_as_cpu(x: jax.Array, axis: tuple[int, ...], keepdims: bool = True) -> jax.Array:
    """jnp.sum(x, axis, keepdims=True) with XLA:CPU's rounding on every backend (see above).

    On the CPU (unless forced) it is jnp.sum itself; elsewhere the order is written out.
    """
    assert keepdims, "kept axes only"
    axes = tuple(sorted({a % x.ndim for a in axis}))
    if not _use_float64():
        return jnp.sum(x, axis=axes, keepdims=True)
    return _cpu_sum(x, axes)


def reciprocal(b: jax.Array | float, dtype: jnp.dtype) -> jax.Array | float:
    """1 / b as the broadcast division of `dtype` computes it (see above)."""
    f16 = np.dtype(dtype) == np.dtype(jnp.float16)
    if isinstance(b, float | int):
        r = np.float32(1) / np.float32(const(b, dtype))
        return const(r, dtype) if f16 else float(r)
    b = widen(b)
    r = _correctly_rounded(lambda d: 1 / d, b)
    return fit(r, dtype) if f16 else r


def settle(v: jax.Array) -> jax.Array:
    """v, rounded now: keeps a product from fusing with a following add into an FMA.

    XLA's CPU/GPU backends contract `a * b + c` into one FMA (one rounding instead of two). A
    select between the multiply and the add blocks that; narrow floats get the same effect from
    `fit`. A NaN becomes 0 here, which only matters for NaN input (see qarray on NaN).
    """
    if np.dtype(v.dtype) in _NARROW:
        return v
    return jnp.where(v == v, v, jnp.zeros_like(v))


def opaque(c: float, like: jax.Array) -> jax.Array:
    """Constant c shaped like `like`, hidden from XLA's constant folding and reassociation.

    `(a * c1) * c2 -> a * (c1 * c2)` or `a * c - b * c -> (a - b) * c` are legal for XLA but not
    for us: each op must round as the reference's did.
    """
    like = widen(like)
    return c + like * 0


def multiply_const(a: jax.Array, c: float, dtype: jnp.dtype) -> jax.Array:
    """`a * c` in `dtype` (wide out) with c a Python constant, weakly typed to `dtype`."""
    return settle(fit(widen(a) * opaque(const(c, dtype), a), dtype))


def divide_broadcast(a: jax.Array, b: jax.Array | float, dtype: jnp.dtype) -> jax.Array:
    """`a / b` in `dtype` (wide in, wide out) where b is broadcast against a."""
    if a.size == np.size(b):  # nothing is broadcast (one element): a true division
        return divide_exact(a, jnp.broadcast_to(jnp.asarray(b, wide_dtype(dtype)), a.shape), dtype)
    r = reciprocal(b, dtype)
    return fit(widen(a) * (opaque(r, a) if isinstance(r, float) else r), dtype)


def divide_exact(a: jax.Array, b: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`a / b` in `dtype` (wide in, wide out) where b has a's shape: a true division."""
    a = widen(a)
    return fit(_correctly_rounded(jnp.divide, a, widen(b) + a * 0), dtype)


def _snap_pow2(scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """mx formats: the scale rounded up to a power of two, 2^ceil(log2(scale)).

    The reference takes log2 in the scale's dtype as jnp does (log(s) / log(2), each op rounded
    to the dtype, the division a multiply by the rounded reciprocal), so a scale just above a
    power of two may stay on it in bf16/f16; the power itself is exact. (docs/numerics-spec.md
    describes a "× c, keep the bf16 exponent" rule; the reference 0.1.8 measurably does this
    instead.)
    """
    log = fit(jnp.log(scale), dtype)
    log2 = divide_broadcast(log, float(np.log(2.0)), dtype)
    exponent = jnp.ceil(log2).astype(jnp.int32)
    return jnp.ldexp(jnp.ones_like(scale), exponent)


def _divide_by(a: jax.Array, c: float, dtype: jnp.dtype, torch: bool) -> jax.Array:
    """a / c in `dtype`: as the reference's broadcast division, or (torch) a true one."""
    if not torch or np.dtype(dtype) == np.dtype(jnp.bfloat16):
        # bfloat16: the reciprocal multiply gives the true quotient's bits (TORCH), faster.
        return divide_broadcast(a, c, dtype)
    return divide_exact(a, jnp.full(a.shape, const(c, dtype), wide_dtype(dtype)), dtype)


def _torch_mx_scale(absmax: jax.Array, bound: float, dtype: jnp.dtype) -> jax.Array:
    """compressed-tensors' MX scale: absmax rounded to a power of two p on its bits (up when the
    mantissa is >= 0.75, as 0.25 added to the fraction carries), then 2^(log2 p - floor(log2
    bound)) with the biased exponent clamped to E8M0's 0..255 (p = 0 gives 2^-127). Not the
    reference's 2^ceil(log2(absmax / bound)), which may pick the next power up."""
    info = ml_dtypes.finfo(dtype)
    mant = int(info.nmant)
    width = np.dtype(dtype).itemsize * 8
    uint = {16: jnp.uint16, 32: jnp.uint32}[width]
    bits = jax.lax.bitcast_convert_type(fit(absmax, dtype).astype(dtype), uint).astype(jnp.uint32)
    field = ((bits + (1 << (mant - 2))) >> mant) & ((1 << (width - 1 - mant)) - 1)
    bias = int(info.maxexp) - 1
    offset = int(np.floor(np.log2(bound)))
    biased = jnp.clip(field.astype(jnp.int32) - bias - offset + 127, 0, 255)
    biased = jnp.where(field == 0, 0, biased)
    if bias != 127:  # float16: 2^(biased - 127) rounds as PyTorch's cast to float16 does
        return widen(jnp.ldexp(jnp.ones(biased.shape, jnp.float32), biased - 127).astype(dtype))
    # bfloat16 / float32 share E8M0's exponent range: the scale is built from its bits, because
    # 2^-127 (biased 0, an all-zero group) is subnormal, which XLA:CPU flushes to zero in
    # arithmetic; _codes divides such groups by 1 instead.
    pattern = jnp.where(biased == 0, 1 << (mant - 1), biased.astype(jnp.uint32) << mant)
    return widen(jax.lax.bitcast_convert_type(pattern.astype(uint), dtype))


# The scale compressed-tensors puts in place of an E4M3 scale of 0.
_E4M3_ZERO_SCALE = 0.125


def _replace_tiny(scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    # A scale this small would overflow x / scale; 1 keeps all-zero blocks exact.
    tiny = float(np.sqrt(ml_dtypes.finfo(dtype).tiny))
    return jnp.where(scale < tiny, jnp.ones_like(scale), scale)


# Whose arithmetic a quantization follows: the reference's (Qwix on XLA), or PyTorch's op by op
# as compressed-tensors quantizes: true divisions where XLA multiplies by a reciprocal, and a
# zero scale replaced by the dtype's eps (not 1). Same bits for bfloat16 tensors (a quotient of
# two bf16 values is never within float32 rounding of a bf16 tie), different for float32/16.
TORCH = "torch"
# The reference's with qarray.USE_RECIPROCAL_FOR_QUANTIZATION set (AQT's): x times the scale's
# reciprocal, both in x's dtype, instead of x / scale.
RECIPROCAL = "reciprocal"
ARITHMETICS = ("", TORCH, RECIPROCAL)


def nv_global_scales(
    absmax: jax.Array, bound: float, global_scale: float | jax.Array, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """NVFP4 with a global scale g, as compressed-tensors computes it with PyTorch: the block
    scale absmax / bound (in `dtype`), times g in float32, saturated to E4M3 and cast (0 becomes
    0.125); the codes divide by that E4M3 scale / g in float32. Returns (E4M3 scale, divisor)."""
    g = jnp.asarray(global_scale, jnp.float32)
    local = _divide_by(absmax, bound, dtype, True).astype(jnp.float32)
    # Rounded by round_e4m3, not by a convert there and back, which XLA:GPU would drop.
    rounded = qcodes.round_e4m3(jnp.clip(local * g, -qcodes.E4M3_MAX, qcodes.E4M3_MAX))
    wide = jnp.where(rounded == 0, jnp.float32(_E4M3_ZERO_SCALE), rounded)
    scale = wide.astype(jnp.float8_e4m3fn)
    divisor = divide_exact(wide, jnp.broadcast_to(g, wide.shape), jnp.float32)
    return scale, divisor


def compute_scale_zero_point(
    calibration: Mapping[str, jax.Array],
    qtype: qtypes.QType | str,
    scale_dtype: jnp.dtype | None = None,
    *,
    torch: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Scale and zero point (None when symmetric) from a calibration dict.

    The scale is computed in the calibration's dtype; `scale_dtype` only casts the result.
    `torch`: PyTorch's arithmetic (see ARITHMETICS).

    Raises:
      ValueError: an asymmetric calibration for a qtype without an asymmetric range.
    """
    qt = qtypes.get(qtype)
    if "absmax" in calibration:
        dtype = calibration["absmax"].dtype
        scale = _divide_by(calibration["absmax"], float(qt.bound), dtype, torch)
        lo = None
    else:
        if qt.asymmetric_range is None:
            allowed = [n for n in qtypes.names() if qtypes.get(n).asymmetric_range]
            raise ValueError(
                f"{qt.name} doesn't support asymmetric calibration (minmax or an asymmetric "
                f"fixed range); use absmax, or one of {allowed}"
            )
        qmin, qmax = qt.asymmetric_range
        dtype = calibration["min"].dtype
        lo, hi = widen(calibration["min"]), widen(calibration["max"])
        scale = _divide_by(fit(hi - lo, dtype), float(qmax - qmin), dtype, torch)
    if qt.scale_rounding == qtypes.POW2 and torch and lo is None:
        scale = _torch_mx_scale(calibration["absmax"], float(qt.bound), dtype)
    elif qt.scale_rounding == qtypes.POW2:
        scale = _snap_pow2(scale, dtype)
    elif qt.scale_rounding == qtypes.E4M3:
        scale = qcodes.round_e4m3(fit(scale, dtype))
    if not torch:
        scale = _replace_tiny(scale, dtype)
    elif qt.scale_rounding != qtypes.POW2:  # an MX scale is never 0 (2^-127 at least)
        eps = float(ml_dtypes.finfo(dtype).eps)
        scale = jnp.where(scale == 0, jnp.asarray(eps, scale.dtype), scale)
    zero_point = None
    if lo is not None:
        shifted = divide_exact(lo, scale, dtype)
        zero_point = jnp.round(fit(opaque(qmin, shifted) - shifted, dtype)).astype(qt.storage)
        if torch:
            # PyTorch computes it before replacing a zero scale: 0 / 0, a NaN stored as 0.
            zero_point = jnp.where(hi == lo, jnp.zeros_like(zero_point), zero_point)
    # The reference quantizes with the scale in the input's dtype and casts only what it stores.
    return scale.astype(scale_dtype or dtype), zero_point


def from_qtype(q: jax.Array, qtype: qtypes.QType | str, dtype: jnp.dtype) -> jax.Array:
    """The real values codes `q` of `qtype` stand for, rounded to `dtype`, in its wide dtype."""
    qt = qtypes.get(qtype)
    if qt.kind == qtypes.LOOKUP:
        levels = np.asarray(qt.levels, np.float32).astype(dtype).astype(wide_dtype(dtype))
        return jnp.take(jnp.asarray(levels), q.astype(jnp.int32), axis=0)
    return fit(q.astype(wide_dtype(dtype)), dtype)


def convert_to(
    x: jax.Array, qtype: Any, noise_fn: Callable[[tuple[int, ...]], jax.Array] | None = None
) -> jax.Array:
    """Codes of `qtype` for x already divided by its scale: integers round half to even and
    saturate, floats clip to the format's range, nf4 takes the nearest level's index.
    `noise_fn` (integer qtypes) adds noise before rounding, in float32: stochastic rounding."""
    qt = qtypes.get(qtype)
    if noise_fn is not None and qt.kind == qtypes.INT:
        x = x.astype(jnp.float32) + noise_fn(tuple(x.shape))
    return qcodes.to_qtype(x, qt)
