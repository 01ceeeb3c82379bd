"""pack_nibbles: 4-bit codes packed in the jitted computation, in qmill's and compressed-tensors'
layouts; unpack_nibbles gives them back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qmill.engine.modelfree import packing


def test_two_codes_per_byte_low_nibble_first() -> None:
    codes = jnp.asarray([1, 2, 3, 4, 5], jnp.uint8)
    assert np.asarray(packing.pack_nibbles(codes)).tolist() == [0x21, 0x43, 0x05]
    # int4 as quantize_bytes gives it: the two's complement nibble (-1 -> 0xF).
    signed = jnp.asarray(np.array([-1, 7, -8], np.int8).view(np.uint8) & 0x0F)
    assert np.asarray(packing.pack_nibbles(signed)).tolist() == [0x7F, 0x08]


@pytest.mark.parametrize("count", [0, 1, 2, 15, 16, 33])
@pytest.mark.parametrize("dtype", [ml_dtypes.int4, ml_dtypes.uint4])
def test_unpack_gives_every_code_back(count, dtype) -> None:
    codes = (np.arange(count, dtype=np.uint8) * 7) % 16
    packed = np.asarray(jax.jit(packing.pack_nibbles)(jnp.asarray(codes)))
    assert packed.dtype == np.uint8 and packed.shape == ((count + 1) // 2,)
    back = packing.unpack_nibbles(packed, np.dtype(dtype), (count,))
    assert back.dtype == dtype and back.view(np.uint8).tolist() == codes.tolist()


def test_int32_words_along_rows_with_offset() -> None:
    """compressed-tensors' pack-quantized layout: code + 8, eight per int32 word along each row,
    the first in the lowest bits, a short row padded with zero nibbles."""
    row = np.arange(-8, 8, dtype=np.int8)  # 16 codes: two words
    codes = jnp.asarray(np.stack([row, row[::-1]]).view(np.uint8) & 0x0F)
    words = np.asarray(packing.pack_nibbles(codes, word=jnp.int32, offset=8))
    assert words.dtype == np.int32 and words.shape == (2, 2)
    assert words[0].view(np.uint32).tolist() == [0x76543210, 0xFEDCBA98]
    assert words[1].view(np.uint32).tolist() == [0x89ABCDEF, 0x01234567]
    short = np.asarray(packing.pack_nibbles(codes[:, :3], word=jnp.int32, offset=8))
    assert short.shape == (2, 1) and short.view(np.uint32).tolist() == [[0x210], [0xDEF]]


def test_rank_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="rank >= 1"):
        packing.pack_nibbles(jnp.asarray(3, jnp.uint8))
