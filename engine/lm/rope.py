"""Rotary position embeddings: the inverse frequencies and the cos/sin scaling of each rope type,
computed in float32 with the formulas transformers uses (its modeling_rope_utils), so cos and sin
match its to the last bit or two.

They depend on the sequence length only for "dynamic" (the base grows past
max_position_embeddings) and "longrope" (long factors past the original context), and the length
is static under jit, so they are numpy constants of the trace.
"""

from __future__ import annotations

import math

import numpy as np

from qmill.engine.lm import config as config_lib

_F32 = np.float32


def rotary_dim(rope: config_lib.Rope, head_dim: int) -> int:
    """How many leading channels of a head rotate (all but for a partial_rotary_factor < 1)."""
    return int(head_dim * rope.partial_rotary_factor)


def inv_freq(rope: config_lib.Rope, head_dim: int, seq_len: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies (rotary_dim // 2,) float32, the factor cos and sin are scaled by)."""
    dim = rotary_dim(rope, head_dim)
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(_F32) / _F32(dim)
    kind = rope.kind
    if kind in ("default", "linear", "llama3"):
        freq = _F32(1.0) / (_F32(rope.theta) ** exponents)
        if kind == "linear":
            freq = freq / _F32(rope.factor)
        elif kind == "llama3":
            freq = _llama3(rope, freq)
        return freq.astype(_F32), 1.0
    if kind == "dynamic":
        length = max(seq_len, rope.max_position_embeddings)
        ratio = rope.factor * length / rope.max_position_embeddings - (rope.factor - 1)
        base = rope.theta * ratio ** (dim / (dim - 2))
        return (_F32(1.0) / (_F32(base) ** exponents)).astype(_F32), 1.0
    if kind == "yarn":
        return _yarn(rope, dim, exponents)
    if kind == "longrope":
        return _longrope(rope, dim, exponents, seq_len)
    raise ValueError(f"rope type {kind!r} is not supported")


def _llama3(rope: config_lib.Rope, freq: np.ndarray) -> np.ndarray:
    """Llama 3.1: long wavelengths divided by the factor, short ones kept, a smooth ramp
    between."""
    old = rope.original_max_position_embeddings
    low_wavelen = old / rope.low_freq_factor
    high_wavelen = old / rope.high_freq_factor
    wavelen = _F32(2 * math.pi) / freq
    scaled = np.where(wavelen > low_wavelen, freq / _F32(rope.factor), freq).astype(_F32)
    smooth = (_F32(old) / wavelen - _F32(rope.low_freq_factor)) / _F32(
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (_F32(1) - smooth) * scaled / _F32(rope.factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(_F32)


def _yarn(rope: config_lib.Rope, dim: int, exponents: np.ndarray) -> tuple[np.ndarray, float]:
    """YaRN: interpolated (divided by the factor) low frequencies, extrapolated (kept) high ones,
    a linear ramp between; cos and sin scaled by 0.1 ln(factor) + 1 (or as mscale says)."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = rope.factor
    attention = rope.attention_factor
    if attention is None:
        if rope.mscale and rope.mscale_all_dim:
            attention = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        length = rope.original_max_position_embeddings
        return dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = (np.arange(dim // 2, dtype=_F32) - _F32(low)) / _F32(high - low)
    extrapolation = _F32(1) - np.clip(ramp, 0, 1).astype(_F32)
    pos_freqs = _F32(rope.theta) ** exponents
    freq_extra = _F32(1.0) / pos_freqs
    freq_inter = _F32(1.0) / (_F32(factor) * pos_freqs)
    freq = freq_inter * (_F32(1) - extrapolation) + freq_extra * extrapolation
    return freq.astype(_F32), float(attention)


def _longrope(
    rope: config_lib.Rope, dim: int, exponents: np.ndarray, seq_len: int
) -> tuple[np.ndarray, float]:
    """LongRoPE (Phi-3): per-frequency divisors, the long ones past the original context."""
    original = rope.original_max_position_embeddings
    factor = rope.factor
    attention = rope.attention_factor
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = rope.long_factor if seq_len > original else rope.short_factor
    if len(ext) != dim // 2:
        raise ValueError(f"longrope needs {dim // 2} factors per list, got {len(ext)}")
    freq = _F32(1.0) / (np.asarray(ext, _F32) * _F32(rope.theta) ** exponents)
    return freq.astype(_F32), float(attention)


def cos_sin(rope: config_lib.Rope, head_dim: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (seq_len, rotary_dim) float32 of positions 0..seq_len-1, each frequency
    twice (the halves layout of transformers' rotate_half), times the attention scaling."""
    freq, scaling = inv_freq(rope, head_dim, seq_len)
    angles = np.arange(seq_len, dtype=_F32)[:, None] * freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return (np.cos(angles) * _F32(scaling)).astype(_F32), (np.sin(angles) * _F32(scaling)).astype(
        _F32
    )
