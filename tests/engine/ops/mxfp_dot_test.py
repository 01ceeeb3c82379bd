"""ops.mxfp_dot: block-scaled products of mx / nv QArrays (block_scaled_dot_general), None
otherwise; mxfp_dot_general gives them on a GPU only, None elsewhere, as the reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qmill.engine import qarray
from qmill.engine.ops import mxfp_dot
from tests import random_inputs

KEYS = jax.random.split(jax.random.key(0), 2)
A = random_inputs.normal(KEYS[0], (2, 4, 64), jnp.float32)
B = random_inputs.normal(KEYS[1], (2, 64, 8), jnp.float32)
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
    out = mxfp_dot.block_scaled_dot_general(qa, qb, DIMS)
    expected = jnp.einsum("bmk,bkn->bmn", qarray.dequantize(qa), qarray.dequantize(qb))
    assert out.shape == (2, 4, 8) and out.dtype == jnp.float32
    # Block products summed in another order than one f32 matmul: a few ulps of |out| ~ 10.
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    hlo = jax.jit(mxfp_dot.block_scaled_dot_general, static_argnums=2).lower(qa, qb, DIMS).as_text()
    assert "bf16>" in hlo  # the codes (exact in bf16) reach the matmul, not dequantized values


def test_not_applicable_returns_none() -> None:
    qa = _q(A, "mxfp8", (0, 1), 2, 32)
    qb = _q(B, "mxfp8", (0, 2), 1, 32)
    assert mxfp_dot.block_scaled_dot_general(A, qb, DIMS) is None  # one side only
    int8 = qarray.quantize(B, qarray.HowToQuantize(qtype="int8", channelwise_axes=(0, 2)))
    assert mxfp_dot.block_scaled_dot_general(qa, int8, DIMS) is None
    qb16 = _q(B, "mxfp8_16", (0, 2), 1, 16)
    assert mxfp_dot.block_scaled_dot_general(qa, qb16, DIMS) is None  # blocks of 32 vs 16
    assert mxfp_dot.is_mx_qtype("nvfp4") and not mxfp_dot.is_mx_qtype(jnp.int8)


@pytest.fixture
def platform(monkeypatch: pytest.MonkeyPatch):
    """Sets the platform mxfp_dot_general sees (its lookup is cached, so cleared around)."""

    def set_platform(name: str) -> None:
        device = type("Device", (), {"platform": name})()
        monkeypatch.setattr(jax, "devices", lambda *_: [device])
        mxfp_dot._get_primary_platform.cache_clear()

    yield set_platform
    mxfp_dot._get_primary_platform.cache_clear()


def test_dispatcher_falls_back_off_gpu_as_the_reference(platform) -> None:
    qa = _q(A, "mxfp8", (0, 1), 2, 32)
    qb = _q(B, "mxfp8", (0, 2), 1, 32)
    platform("cpu")
    assert mxfp_dot.mxfp_dot_general(qa, qb, DIMS) is None
    platform("gpu")
    out = mxfp_dot.mxfp_dot_general(qa, qb, DIMS)
    np.testing.assert_array_equal(out, mxfp_dot.block_scaled_dot_general(qa, qb, DIMS))
    assert mxfp_dot.mxfp_dot_general(qa, B, DIMS) is None  # one side only, even on a GPU


def test_flatten_to_3d_and_back() -> None:
    qa = _q(A, "mxfp8", (0, 1), 2, 32)  # (2, 4, 64), scale (2, 4, 2)
    codes, scale = mxfp_dot._flatten_to_3d(qa, (2,), (0,))
    assert codes.shape == (2, 4, 64) and scale.shape == (2, 4, 2)
    broadcast = qarray.QArray(jnp.ones((2, 4, 32)), jnp.ones((1, 4, 1)), qtype="mxfp8")
    assert mxfp_dot._flatten_to_3d(broadcast, (2,), (0,))[1].shape == (2, 4, 1)
    lhs = qarray.QArray(jnp.ones((2, 3, 4, 32)), jnp.ones((2, 3, 4, 1)), qtype="mxfp8")
    rhs = qarray.QArray(jnp.ones((2, 3, 6, 32)), jnp.ones((2, 3, 6, 1)), qtype="mxfp8")
    out = mxfp_dot._unflatten_from_3d(
        jnp.ones((6, 4, 6)), lhs, rhs, (((3,), (3,)), ((0, 1), (0, 1)))
    )
    assert out.shape == (2, 3, 4, 6)
