"""Divisions and square roots are correctly rounded on every backend (numerics, "Same bits").

XLA:CPU divides float32 exactly, so on CPU the golden tests cannot tell an exact division from an
approximate one; XLA:GPU's float32 division is not correctly rounded. What makes the GPU agree
is where the arithmetic happens, so these tests check that in the compiled program: with the
float64 route forced (the default on GPUs), every divide and sqrt of the quantization runs in
float64 and nothing float64 leaks into the outputs. They also check the float64 route gives
numpy's correctly rounded float32 results on hard operands. golden_test.py runs every reference
case through it too.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qmill.engine import averaging, numerics, qarray

# "%name = f32[4,8]{1,0} divide(...)" in XLA's compiled HLO text.
_OP = re.compile(r"=\s*(\w+)\[[^\]]*\](?:\{[^}]*\})?\s+(divide|sqrt|rsqrt)\(")


@pytest.fixture(autouse=True)
def float64_route():
    with numerics.float64_arithmetic(True):
        yield


def _arith_dtypes(fn, *args) -> list[tuple[str, str]]:
    text = jax.jit(fn).lower(*args).compile().as_text()
    return _OP.findall(text)


@pytest.mark.parametrize(
    ("dtype", "qtype", "method", "tiled"),
    [
        (jnp.float32, "int8", "absmax", ()),
        (jnp.bfloat16, "int4", "absmax", ((1, 4),)),
        (jnp.float16, "int8", "minmax", ()),
        (jnp.float32, "int8", "rms,3", ()),
        (jnp.bfloat16, "float8_e4m3fn", "absmax", ()),
    ],
)
def test_quantize_divides_and_roots_only_in_float64(dtype, qtype, method, tiled) -> None:
    how = qarray.HowToQuantize(
        qtype=qtype, channelwise_axes=(0,), tiled_axes=tiled, calibration_method=method
    )
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 8)), dtype)
    ops = _arith_dtypes(lambda a: qarray.quantize(a, how), x)
    assert ops, "expected at least the scale's reciprocal"
    assert {d for d, _ in ops} == {"f64"}, ops
    qa = jax.jit(lambda a: qarray.quantize(a, how))(x)
    assert qa.scale.dtype == dtype
    assert qa.zero_point is None or qa.zero_point.dtype != jnp.float64


def test_one_element_tiles_divide_elementwise_in_float64() -> None:
    # Tile 1 on every axis: the scale has x's shape and the division is a true elementwise one.
    how = qarray.HowToQuantize(qtype="int8", tiled_axes={0: 1, 1: 1})
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 8)), jnp.float32)
    ops = _arith_dtypes(lambda a: qarray.quantize(a, how), x)
    assert ("f64", "divide") in ops and {d for d, _ in ops} == {"f64"}, ops


def test_static_range_average_divides_in_float64() -> None:
    stat = averaging.init({"absmax": jnp.zeros((3,), jnp.float32)})
    for v in (1.0, 2.0, 4.0):
        stat = averaging.update(stat, {"absmax": jnp.full((3,), v, jnp.float32)})
    ops = _arith_dtypes(averaging.calibration, stat)
    assert ops and {d for d, _ in ops} == {"f64"}, ops
    np.testing.assert_array_equal(
        averaging.calibration(stat)["absmax"], np.full((3,), np.float32(7) * (1 / np.float32(3)))
    )


def _hard_operands(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Random float32 pairs over many binades, plus quotients close to rounding ties."""
    rng = np.random.default_rng(2)
    a = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-60, 60, n)).astype(np.float32)
    b = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-60, 60, n)).astype(np.float32)
    # a = b·q + half an ulp of q (rounded to float32): the exact quotient sits near a tie.
    q = rng.uniform(1, 2, n).astype(np.float32)
    near = (b.astype(np.float64) * (q + np.spacing(q) / 2)).astype(np.float32)
    return np.concatenate([a, near]), np.concatenate([b, b])


def test_divide_exact_is_numpys_correctly_rounded_float32_division() -> None:
    a, b = _hard_operands(4096)
    got = jax.jit(lambda u, v: numerics.divide_exact(u, v, jnp.float32))(a, b)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), (a / b).view(np.uint32))


def test_reciprocal_and_sqrt_are_correctly_rounded() -> None:
    a, b = _hard_operands(4096)
    recip = jax.jit(lambda v: numerics.reciprocal(v, jnp.float32))(b)
    np.testing.assert_array_equal(np.asarray(recip), np.float32(1) / b)
    root = jax.jit(numerics.sqrt)(a)
    np.testing.assert_array_equal(np.asarray(root), np.sqrt(a))
    h = np.random.default_rng(3).uniform(2.0**-10, 2.0**10, 4096).astype(np.float16)
    f16 = jax.jit(lambda v: numerics.reciprocal(v, jnp.float16))(h)
    expected = (np.float32(1) / h.astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(np.asarray(f16).astype(np.float16), expected)


def test_the_cpu_default_divides_in_float32() -> None:
    # XLA:CPU's float32 ÷ is IEEE already; float64 there only slows the loop (numerics).
    how = qarray.HowToQuantize(qtype="int8", channelwise_axes=(0,))
    x = jnp.ones((8, 8), jnp.float32)
    with numerics.float64_arithmetic(None):
        ops = _arith_dtypes(lambda a: qarray.quantize(a, how), x)
    expected = "f64" if jax.default_backend() in ("gpu", "cuda", "rocm") else "f32"
    assert ops and {d for d, _ in ops} == {expected}, ops
