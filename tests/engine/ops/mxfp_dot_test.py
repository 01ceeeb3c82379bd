"""ops.mxfp_dot.mxfp_dot_general: block-scaled products of mx / nv QArrays, None otherwise."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qmill.engine import qarray
from qmill.engine.ops import mxfp_dot

KEYS = jax.random.split(jax.random.key(0), 2)
A = jax.random.normal(KEYS[0], (2, 4, 64), jnp.float32)
B = jax.random.normal(KEYS[1], (2, 64, 8), jnp.float32)
DIMS = (((2,), (1,)), ((0,), (0,)))  # batched matmul


def _q(x, qtype, channelwise, axis, tile):
    how = qarray.HowToQuantize(qtype=qtype, channelwise_axes=channelwise, tiled_axes={axis: tile})
    return qarray.quantize(x, how)


@pytest.mark.parametrize(
    ("qtype", "tile"), [("mxfp8", 32), ("mxfp4", 32), ("mxfp8_16", 16), ("nvfp4", 16)]
)
def test_block_scaled_product_matches_dequantized(qtype, tile) -> None:
    qa = _q(A, qtype, (0, 1), 2, tile)
    qb = _q(B, qtype, (0, 2), 1, tile)
    out = mxfp_dot.mxfp_dot_general(qa, qb, DIMS)
    expected = jnp.einsum("bmk,bkn->bmn", qarray.dequantize(qa), qarray.dequantize(qb))
    assert out.shape == (2, 4, 8) and out.dtype == jnp.float32
    # Block products summed in another order than one f32 matmul: a few ulps of |out| ~ 10.
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    hlo = jax.jit(mxfp_dot.mxfp_dot_general, static_argnums=2).lower(qa, qb, DIMS).as_text()
    assert "bf16>" in hlo  # the codes (exact in bf16) reach the matmul, not dequantized values


def test_not_applicable_returns_none() -> None:
    qa = _q(A, "mxfp8", (0, 1), 2, 32)
    qb = _q(B, "mxfp8", (0, 2), 1, 32)
    assert mxfp_dot.mxfp_dot_general(A, qb, DIMS) is None  # one side only
    int8 = qarray.quantize(B, qarray.HowToQuantize(qtype="int8", channelwise_axes=(0, 2)))
    assert mxfp_dot.mxfp_dot_general(qa, int8, DIMS) is None
    qb16 = _q(B, "mxfp8_16", (0, 2), 1, 16)
    assert mxfp_dot.mxfp_dot_general(qa, qb16, DIMS) is None  # blocks of 32 vs 16
    assert mxfp_dot.is_mx_qtype("nvfp4") and not mxfp_dot.is_mx_qtype(jnp.int8)
