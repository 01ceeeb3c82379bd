"""Values in units of a qtype turned into its codes, and codes read back as stored values.

Lingo (numerics.py's): y is x / scale (+ zero_point), already rounded to its dtype; q the stored
code. Integers round half to even and saturate, floats clip to the format's range, nf4 takes the
nearest of its 16 levels; E4M3 values (NVFP4's scales) are rounded on their bits. 4-bit integer
codes can come as the uint8 bytes numpy uses for them (`as_bytes`), which the host views as the
storage dtype for free.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.core import qtypes


@functools.cache
def _nf4_thresholds() -> np.ndarray:
    """Per pair of neighbouring levels, the smallest float32 y whose nearest level is the upper one.

    Matches "nearest of the 16 levels, ties to the lower index" with distances computed in
    float32, exactly: around each midpoint we test neighbouring float32 values with the same
    arithmetic the rule uses, so a comparison count against these thresholds never disagrees
    with an argmin, but costs 15 compares instead of 16 subtractions and a reduction.
    """
    levels = np.asarray(qtypes.NF4_LEVELS, np.float32)
    out = []
    for lower, upper in itertools.pairwise(levels):
        y = np.float32((lower + upper) / 2)
        for _ in range(8):  # step down while still "upper"
            prev = np.nextafter(y, np.float32(-np.inf))
            if abs(prev - upper) < abs(prev - lower):
                y = prev
            else:
                break
        while not abs(y - upper) < abs(y - lower):  # step up until "upper"
            y = np.nextafter(y, np.float32(np.inf))
        out.append(y)
    return np.asarray(out, np.float32)


def _pick(bits: list[jax.Array], values: list[float]) -> jax.Array | float:
    """values[n] where n is the number the bools `bits` spell, most significant first."""
    if not bits:
        return values[0]
    half = len(values) // 2
    return jnp.where(bits[0], _pick(bits[1:], values[half:]), _pick(bits[1:], values[:half]))


def _nf4_codes(y: jax.Array) -> jax.Array:
    """nf4 codes (uint8) of y by binary search over the 15 thresholds: 4 compares per value.

    Each step's threshold is selected by the bits found so far (no gather, no broadcast (…, 16)
    array), so XLA fuses it all into the loop over y. The code equals the count of thresholds
    <= y, as a linear scan would find it; NaN compares false everywhere and gets code 0.
    """
    t = _nf4_thresholds()
    y32 = y.astype(jnp.float32)
    bits: list[jax.Array] = []
    for step in (8, 4, 2, 1):
        # Node k of this level (k = the code's bits so far) splits at threshold k + step - 1.
        bits.append(y32 >= _pick(bits, [t[k + step - 1] for k in range(0, 16, 2 * step)]))
    code = jnp.zeros(y.shape, jnp.uint8)
    for bit in bits:
        code = code * np.uint8(2) + bit.astype(jnp.uint8)
    return code


def _nf4_count(y: jax.Array) -> jax.Array:
    """nf4 codes (uint8) of y as the number of thresholds <= y: 15 compares, no selects."""
    y32 = y.astype(jnp.float32)
    code = jnp.zeros(y.shape, jnp.uint8)
    for t in _nf4_thresholds():
        code = code + (y32 >= t).astype(jnp.uint8)
    return code


def _sub_byte(storage: np.dtype) -> bool:
    return np.dtype(storage) in (np.dtype(jnp.int4), np.dtype(jnp.uint4))


def byte_dtype(qtype: qtypes.QType | str) -> np.dtype:
    """dtype of `to_qtype(..., as_bytes=True)`'s codes: uint8 for 4-bit integer storage."""
    storage = qtypes.get(qtype).storage
    return np.dtype(np.uint8) if _sub_byte(storage) else storage


def to_qtype(y: jax.Array, qtype: qtypes.QType | str, *, as_bytes: bool = False) -> jax.Array:
    """Converts y (x in units of the qtype, already rounded to its dtype) to codes of `qtype`.

    With `as_bytes`, codes of 4-bit integer storage (int4, uint4, nf4) come as uint8 holding the
    bytes numpy (ml_dtypes) uses for that dtype — the low 4 bits, two's complement for int4 — so
    the host can `view` them as the storage dtype for free. XLA:CPU writes packed 4-bit arrays
    element by element, ~10x slower than the whole quantization; callers that move the codes to
    the host anyway (leaf.py) skip that.
    """
    qt = qtypes.get(qtype)
    if qt.kind == qtypes.LOOKUP:
        if as_bytes:
            return _nf4_codes(y)
        # XLA:CPU writes packed uint4 one scalar element at a time; there the branch-free count
        # of thresholds passed beats the search's nested selects (~2x), in vector loops not.
        return _nf4_count(y).astype(qt.storage)
    if qt.kind == qtypes.FLOAT:
        return jnp.clip(y, qt.qmin, qt.qmax).astype(qt.storage)
    # Integers: round half to even, then saturate (the half step past qmax lands here).
    q = _round_saturate(y, qt.qmin, qt.qmax)
    if as_bytes and _sub_byte(qt.storage):
        return (q.astype(jnp.int32) & 0xF).astype(jnp.uint8)
    return q.astype(qt.storage)


# 1.5 · 2^23: float32 values in [2^23, 2^24) are exactly the integers, so adding this rounds.
_MAGIC = np.float32(1.5 * 2**23)


def _round_saturate(y: jax.Array, qmin: float, qmax: float) -> jax.Array:
    """clip(round_half_even(y), qmin, qmax): int32 for float32 y, else y's dtype.

    For float32 (every narrow input is carried in it) the rounding is `y + 1.5·2^23`, whose
    result the add itself rounds half to even to an integer (its spacing there is 1; adding an
    even integer keeps ties' parity), read back from the bits. It is exact for |y| <= 2^22,
    hence clipping first (clip and round commute for integer bounds), and ~1.7x faster on
    XLA:CPU than round + clip + convert. A NaN gives 0, as the float→int convert did.
    """
    if np.dtype(y.dtype) != np.dtype(np.float32) or max(-qmin, qmax) > 2**22:
        return jnp.clip(jnp.round(y), qmin, qmax)
    shifted = jnp.clip(y, qmin, qmax) + _MAGIC
    q = jax.lax.bitcast_convert_type(shifted, jnp.int32) - _MAGIC.view(np.int32)
    return jnp.where(y == y, q, 0)


def from_bytes(codes: jax.Array, qtype: qtypes.QType | str) -> jax.Array:
    """Codes from `to_qtype(..., as_bytes=True)` as values of the storage type (int32 for int4)."""
    qt = qtypes.get(qtype)
    if np.dtype(codes.dtype) != np.dtype(np.uint8) or np.dtype(qt.storage) != np.dtype(jnp.int4):
        return codes
    v = codes.astype(jnp.int32)
    return v - ((v & 8) << 1)  # sign-extend the low 4 bits


# E4M3's largest value.
E4M3_MAX = 448.0


def round_e4m3(v: jax.Array) -> jax.Array:
    """v (a wide float) rounded to a float8_e4m3fn value, in v's dtype: as XLA's convert rounds
    (to nearest even; past 464 and for ±inf a NaN), by integer arithmetic on v's bits.

    Not `v.astype(float8_e4m3fn).astype(v.dtype)`: XLA:GPU (with its default
    xla_allow_excess_precision) removes such a chain of converts, so nvfp4's scales went
    unrounded there (H200, 2026-11-27). Nothing here is a convert it could drop.
    """
    dtype = np.dtype(v.dtype)
    uint = {4: jnp.uint32, 8: jnp.uint64}[dtype.itemsize]
    nmant = int(np.finfo(dtype).nmant)
    bits = jax.lax.bitcast_convert_type(v, uint)
    sign = bits & (uint(1) << (8 * dtype.itemsize - 1))
    mag = bits ^ sign
    # Normal E4M3 (>= 2^-6): keep 3 fraction bits, ties to even; a carry moves the exponent up.
    drop = nmant - 3
    lsb = (mag >> drop) & 1
    rounded = ((mag + ((uint(1) << (drop - 1)) - 1) + lsb) >> drop) << drop
    too_big = rounded > jax.lax.bitcast_convert_type(jnp.asarray(E4M3_MAX, dtype), uint)
    # Below 2^-6 E4M3 is subnormal: multiples of 2^-9, ties to even. Exact float steps.
    small = jnp.abs(v) < 2.0**-6
    sub = jax.lax.bitcast_convert_type(jnp.round(jnp.abs(v) * 2.0**9) * 2.0**-9, uint)
    nan = jax.lax.bitcast_convert_type(jnp.asarray(np.nan, dtype), uint)
    out = jnp.where(small, sub, jnp.where(too_big, nan, rounded))
    return jax.lax.bitcast_convert_type(sign | out, dtype)
