"""4-bit codes packed into words inside a jitted computation, in the layouts writers store.

A packed array is what leaves the device, so the host never repacks: qmill's own layout is two
codes per byte, low nibble first, over the flattened tensor (`pack_nibbles(codes.reshape(-1))`);
compressed-tensors' pack-quantized layout is eight codes per int32 word along each row, the
first code in the lowest bits, codes offset to unsigned (`pack_nibbles(codes, word=jnp.int32,
offset=8)` for int4).

Packing is shifts and ors on whole arrays: XLA fuses it with the quantization that makes the
codes, on the CPU as on accelerators, where writing int4/uint4 arrays element by element (as
XLA:CPU does for those dtypes) would cost more than the quantization.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Codes per word, by the word's size in bytes.
_PER_WORD = {1: 2, 2: 4, 4: 8}


def codes_per_word(word: Any) -> int:
    """How many 4-bit codes one word of dtype `word` holds."""
    return _PER_WORD[np.dtype(word).itemsize]


def pack_nibbles(codes: jax.Array, *, word: Any = jnp.uint8, offset: int = 0) -> jax.Array:
    """Packs 4-bit codes along the last axis: the result's last axis is ceil(n / k) words.

    `codes`: integers whose low 4 bits are the codes (as qarray.quantize_bytes gives 4-bit
    qtypes: uint8, two's complement nibbles for int4), any shape of rank >= 1. `offset` is added
    before taking the low 4 bits (compressed-tensors stores int4 as code + 8). A last axis that
    is not a multiple of k = codes_per_word(word) is padded with zero nibbles. Jittable.
    """
    if codes.ndim == 0:
        raise ValueError("pack_nibbles needs an array of rank >= 1")
    size = np.dtype(word).itemsize
    nibbles = codes.astype(jnp.uint8)  # the low byte; only its low nibble counts
    if offset % 16:
        nibbles = nibbles + jnp.uint8(offset % 16)
    lead = codes.shape[:-1]
    pad = -codes.shape[-1] % codes_per_word(word)
    if pad:
        nibbles = jnp.pad(nibbles, [(0, 0)] * len(lead) + [(0, pad)])
    # Two codes as one little-endian uint16 (the first in the low byte), its nibbles moved
    # together: XLA:CPU fuses this with the quantizing loop, where gathering even and odd codes
    # with strided slices computed every code twice and ran ~10x slower.
    pairs = jax.lax.bitcast_convert_type(nibbles.reshape(*lead, -1, 2), jnp.uint16)
    packed = ((pairs & 0xF) | ((pairs >> 4) & 0xF0)).astype(jnp.uint8)
    if size == 1:
        return packed if np.dtype(word) == np.uint8 else packed.astype(word)
    # Words of several bytes: the bytes in little-endian order, so code 0 is in the lowest bits.
    return jax.lax.bitcast_convert_type(packed.reshape(*lead, -1, size), word)


def unpack_nibbles(packed: np.ndarray, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Host side: the array of 4-bit `dtype` and `shape` that `pack_nibbles(codes.reshape(-1))`
    packed into `packed` (a copy)."""
    nibbles = np.empty(packed.size * 2, np.uint8)
    nibbles[0::2] = packed & 0x0F
    nibbles[1::2] = packed >> 4
    # ml_dtypes keeps a 4-bit code in the low nibble of its byte.
    return nibbles[: math.prod(shape)].view(dtype).reshape(shape)
