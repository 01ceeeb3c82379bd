"""einsum ellipsis / broadcasting and conv dtypes as the reference's public API behaves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qmill.engine import ops, qarray
from tests import random_inputs


def _normal(i: int, shape: tuple[int, ...]) -> jax.Array:
    return random_inputs.normal(jax.random.key(i), shape, jnp.float32)


@pytest.mark.parametrize(
    ("spec", "lhs_shape", "rhs_shape"),
    [
        ("...ab,...bc->...ac", (2, 3, 4, 8), (2, 3, 8, 5)),
        ("...qhd,...khd->...hqk", (2, 6, 4, 8), (2, 7, 4, 8)),
        ("...ab,bc", (2, 3, 4, 8), (8, 5)),  # implicit output keeps the ellipsis first
        ("...ab,...bc->...ac", (1, 3, 4, 8), (2, 3, 8, 5)),  # size-1 ellipsis axis broadcasts
        ("...ab,...bc->...ac", (3, 4, 8), (2, 3, 8, 5)),  # fewer ellipsis axes: right-aligned
        ("bij,bjk->bik", (1, 3, 4), (5, 4, 6)),  # named size-1 batch axis broadcasts
        ("bij,bjk->bki", (5, 3, 4), (1, 4, 6)),
    ],
)
def test_float_einsum_matches_jnp(spec, lhs_shape, rhs_shape) -> None:
    lhs, rhs = _normal(0, lhs_shape), _normal(1, rhs_shape)
    out = ops.einsum.einsum(spec, lhs, rhs)
    # Same products summed in a possibly different order by XLA: a few f32 ulps.
    np.testing.assert_allclose(out, jnp.einsum(spec, lhs, rhs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("spec", "lhs_shape", "rhs_shape"),
    [
        ("...ab,...bc->...ac", (1, 3, 4, 16), (2, 3, 16, 5)),
        ("...qhd,...khd->...hqk", (2, 6, 4, 16), (2, 7, 4, 16)),
    ],
)
def test_quantized_einsum_with_ellipsis_multiplies_int8(spec, lhs_shape, rhs_shape) -> None:
    ndims = (len(lhs_shape), len(rhs_shape))
    hows = [
        ops.einsum.get_how_to_quantize(einsum_str=spec, ndims=ndims, for_lhs=f, qtype="int8")
        for f in (True, False)
    ]
    ql = qarray.quantize(_normal(0, lhs_shape), hows[0])
    qr = qarray.quantize(_normal(1, rhs_shape), hows[1])
    # Channelwise on every non-contracted axis, the ellipsis included.
    assert ql.scale.shape == (*lhs_shape[:-1], 1)
    out = ops.einsum.einsum(spec, ql, qr)
    expected = jnp.einsum(spec, qarray.dequantize(ql), qarray.dequantize(qr))
    # int32 accumulation then two scale multiplies vs f32 sums of dequantized values.
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    hlo = jax.jit(lambda a, b: ops.einsum.einsum(spec, a, b)).lower(ql, qr).as_text()
    assert "xi32>" in hlo  # the native integer path, not a dequantized fallback


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("...ab,...bc->ac", "keep the ellipsis"),
        ("a.b,bc->ac", "malformed ellipsis"),
        ("ab,bc->ac", "ranks"),
    ],
)
def test_bad_einsum_specs_say_what_is_wrong(spec, error) -> None:
    with pytest.raises(ValueError, match=error):
        ops.einsum.einsum(spec, _normal(0, (2, 3, 4)), _normal(1, (4, 5)))


def test_non_broadcastable_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="Cannot broadcast"):
        ops.einsum.einsum("bij,bjk->bik", _normal(0, (2, 3, 4)), _normal(1, (3, 4, 5)))
    with pytest.raises(ValueError, match="Cannot broadcast"):
        ops.einsum.einsum("BTNH,BSNH->BTNS", jnp.ones((1, 2, 3, 8)), jnp.ones((1, 3, 4, 8)))


@pytest.mark.parametrize("quantized", [False, True])
def test_batch_axis_dividing_the_other_repeats(quantized) -> None:
    # 4 key/value heads shared by 8 query heads: each of the 4 serves 2 consecutive heads.
    q, k = _normal(0, (1, 2, 8, 16)), _normal(1, (1, 3, 4, 16))
    if quantized:
        how = qarray.HowToQuantize(qtype="int8", channelwise_axes=(0, 1, 2))
        q, k = qarray.quantize(q, how), qarray.quantize(k, how)
    out = ops.einsum.einsum("BTNH,BSNH->BTNS", q, k)
    dq = qarray.dequantize(q) if quantized else q
    dk = qarray.dequantize(k) if quantized else k
    expected = jnp.einsum("BTNH,BSNH->BTNS", dq, jnp.repeat(dk, 2, axis=2))
    assert out.shape == (1, 2, 8, 3)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_scalar_operand() -> None:
    x = _normal(0, (4, 4))
    np.testing.assert_array_equal(ops.einsum.einsum("ij,->ij", x, jnp.array(2.0)), x * 2.0)


DIMS = ("NHWC", "HWIO", "NHWC")


def _conv(lhs, rhs, **kw):
    return ops.conv_general.conv_general_dilated(
        lhs, rhs, (1, 1), "SAME", dimension_numbers=DIMS, **kw
    )


def test_conv_int8_by_int8_accumulates_in_int32() -> None:
    lhs = jnp.full((1, 4, 4, 2), 100, jnp.int8)
    rhs = jnp.full((3, 3, 2, 5), 100, jnp.int8)
    out = _conv(lhs, rhs)
    assert out.dtype == jnp.int32
    # An inner pixel sums 3·3·2 products of 100·100: far past int8's range.
    assert int(out[0, 1, 1, 0]) == 18 * 100 * 100


@pytest.mark.parametrize("groups", [1, 2])
def test_a_gpu_convolves_int8_codes_as_float32_with_the_integer_result(monkeypatch, groups):
    """XLA cannot compile an int8 × int8 → int32 convolution for a GPU (cuDNN: UNIMPLEMENTED,
    bench/gpu/qt_golden.py on an H200); there the codes go through a float32 convolution at
    full precision. Every partial sum of these (3·3·64 = 576 terms of |code| ≤ 127: < 2^24) is
    an exact float32 integer, so the result must equal the CPU's integer convolution exactly."""
    rng = np.random.default_rng(5)
    lhs = jnp.asarray(rng.integers(-127, 128, (2, 6, 6, 64 * groups)), jnp.int8)
    rhs = jnp.asarray(rng.integers(-127, 128, (3, 3, 64, 8)), jnp.int8)
    on_cpu = jax.jit(lambda a, b: _conv(a, b, feature_group_count=groups))
    want = on_cpu(lhs, rhs)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    as_gpu = jax.jit(lambda a, b: _conv(a, b, feature_group_count=groups))
    jaxpr = str(jax.make_jaxpr(as_gpu)(lhs, rhs))
    assert "preferred_element_type=int32" not in jaxpr and "float32" in jaxpr
    got = as_gpu(lhs, rhs)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, want)
    assert np.abs(np.asarray(want)).max() > 2**16  # sums far past what float16 would hold


def test_conv_int8_by_float32_promotes() -> None:
    lhs = jnp.arange(32, dtype=jnp.int8).reshape(1, 4, 4, 2)
    rhs = _normal(0, (3, 3, 2, 5))
    out = _conv(lhs, rhs)
    assert out.dtype == jnp.float32
    expected = _conv(lhs.astype(jnp.float32), rhs)
    np.testing.assert_array_equal(out, expected)
    # A QArray against a float array dequantizes the QArray.
    q = qarray.quantize(
        rhs,
        ops.conv_general.get_how_to_quantize(
            dimension_numbers=jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, DIMS),
            for_lhs=False,
            qtype="int8",
        ),
    )
    out = _conv(lhs, q)
    np.testing.assert_array_equal(out, _conv(lhs.astype(jnp.float32), qarray.dequantize(q)))


def test_dot_general_int8_by_int8_accumulates_in_int32() -> None:
    a = jnp.full((2, 64), 100, jnp.int8)
    out = ops.dot_general.dot_general(a, a.T, (((1,), (0,)), ((), ())))
    assert out.dtype == jnp.int32 and int(out[0, 0]) == 64 * 100 * 100
