"""The GPU's route to the CPU's bits, checked on the CPU (numerics, "Off the CPU"; issue 37).

On an H200 (bench/results/h200-2026-11-27) 16 golden cases differed from the CPU fixtures, for
three reasons a CPU cannot show by its results, so these tests check the mechanism:
  - the float64 division was folded back to float32 by LLVM (fptrunc(fdiv(fpext, fpext)) is
    a float32 fdiv to instcombine), which XLA:GPU lowers to the approximate div.full.f32: the
    float64 operands are now assembled from bits, and the test reads the optimized LLVM IR;
  - nvfp4's E4M3 scale rounding was a convert there and back, a chain XLA:GPU removes: it is
    now integer arithmetic, equal to XLA's convert, and no f8 convert is left in the program;
  - rms sums: XLA:GPU adds in its own tree; the route adds in XLA:CPU's order, which must give
    jnp.sum's bits on the CPU.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qmill.engine import numerics, qarray
from qmill.engine.core import calibration, qcodes, tiling


@pytest.fixture
def gpu_route():
    with numerics.float64_arithmetic(True):
        yield


def _f32(bits) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


def _awkward_float32(n: int) -> np.ndarray:
    """Random bit patterns plus zeros, subnormals, the normal/subnormal edge, inf and NaN."""
    rng = np.random.default_rng(0)
    random = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    edges = [0, 1, 2, 3, 0x400000, 0x7FFFFF, 0x800000, 0x3F800000, 0x7F7FFFFF, 0x7F800000]
    edges += [0x7FC00000, 0x7F800001]  # a quiet and a signalling NaN
    subnormal = np.arange(1, 2**23, 4099, dtype=np.uint32)
    bits = np.concatenate([random, np.asarray(edges, np.uint32), subnormal])
    return _f32(np.concatenate([bits, bits | 0x80000000]))


def test_float64_of_is_the_exact_extension() -> None:
    v = _awkward_float32(1 << 16)
    with jax.enable_x64(True):
        got = np.asarray(jax.jit(numerics._float64_of)(v))
    with np.errstate(invalid="ignore"):
        want = v.astype(np.float64)
    np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))


_LLVM_PROBE = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from qmill.engine import numerics
    a = np.linspace(1, 2, 1000, dtype=np.float32)
    with numerics.float64_arithmetic(True):
        # One fused loop: fpext, fdiv and fptrunc in one kernel, as XLA:GPU fuses them.
        fn = jax.jit(lambda u, v: numerics.divide_exact(u, v, jnp.float32) + u)
        fn(a, a[::-1]).block_until_ready()
    """
)


def test_the_float64_division_survives_llvm(tmp_path: pathlib.Path) -> None:
    # LLVM shrinks fptrunc(fdiv(fpext a, fpext b)) to a float32 fdiv: on a GPU that is
    # div.full.f32 again. XLA:CPU runs the same instcombine, so its optimized IR shows it.
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_dump_to={tmp_path}")
    subprocess.run([sys.executable, "-c", _LLVM_PROBE], env=env, check=True, timeout=120)
    ir = "".join(p.read_text() for p in tmp_path.glob("*jit__lambda*ir-with-opt.ll"))
    fdivs = re.findall(r"fdiv (?:fast )?(<\d+ x \w+>|\w+) ", ir)
    assert fdivs, "expected the division in the dumped LLVM IR"
    assert all("double" in t for t in fdivs), fdivs


def test_round_e4m3_is_xlas_convert() -> None:
    # Every bfloat16 value, and random/awkward float32 ones (all 2^32 float32 were compared
    # once, 2026-11-27: equal, NaN signs included).
    bf16 = np.arange(2**16, dtype=np.uint32) << 16
    v = np.concatenate([_f32(bf16), _awkward_float32(1 << 16)])
    near = np.float32(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max) + np.arange(-40, 40, 0.5)
    v = np.concatenate([v, near.astype(np.float32)])
    got = np.asarray(jax.jit(qcodes.round_e4m3)(v))
    want = np.asarray(
        jax.jit(lambda u: u.astype(jnp.float8_e4m3fn).astype(jnp.float32))(v)
    )  # fmt: skip
    same = (got.view(np.uint32) == want.view(np.uint32)) | (
        np.isnan(got) & np.isnan(want) & (np.signbit(got) == np.signbit(want))
    )
    assert same.all(), v[~same][:8]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_nvfp4_scales_leave_no_convert_xla_gpu_could_drop(dtype) -> None:
    how = qarray.HowToQuantize(qtype="nvfp4", channelwise_axes=(0,), tiled_axes={1: 16})
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 64)), dtype)
    text = jax.jit(lambda a: qarray.quantize(a, how).scale).lower(x).compile().as_text()
    assert "f8e4m3fn" not in text


def test_no_float32_to_float64_convert_in_the_route(gpu_route) -> None:
    # A convert f32 -> f64 is what LLVM folds; the route builds its float64 operands from bits.
    how = qarray.HowToQuantize(qtype="int4", calibration_method="minmax", tiled_axes={1: 16})
    x = jnp.asarray(np.random.default_rng(2).normal(size=(8, 64)), jnp.float32)
    text = jax.jit(lambda a: qarray.quantize(a, how)).lower(x).compile().as_text()
    assert "f64" in text
    assert not re.search(r"= f64\[[^\]]*\](?:\{[^}]*\})? convert\(", text)


# One reduced axis, of lengths with and without padding, below XLA:CPU's YNNPACK threshold
# (4096 input elements: there the CPU's own order is the library's, numerics).
_ONE_AXIS = [((8, 64), 1), ((64, 8), 0), ((8, 48), 1), ((8, 33), 1), ((4, 100), 1), ((3, 1000), 1)]
_ONE_AXIS += [((2, 1500), 1), ((8, 4, 16), 2), ((100, 5), 0), ((1, 4095), 1)]


@pytest.mark.parametrize(("shape", "axis"), _ONE_AXIS)
def test_sum_as_cpu_is_jnp_sum_on_the_cpu(shape, axis, gpu_route) -> None:
    rng = np.random.default_rng(sum(shape))
    x = (rng.normal(size=shape) ** 2 * rng.uniform(0.1, 1000)).astype(np.float32)
    want = np.asarray(jax.jit(lambda a: jnp.sum(a, axis=axis, keepdims=True))(x))
    got = np.asarray(jax.jit(lambda a: numerics.sum_as_cpu(a, (axis,)))(x))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    ("shape", "cw", "tiled"), [((8, 64), (0,), {}), ((16, 128), (0,), {1: 64}), ((40, 8), (1,), {})]
)
def test_rms_scales_are_the_same_on_both_routes(shape, cw, tiled, dtype) -> None:
    tiles = tiling.resolve_tiles(shape, cw, tiled)
    x = jnp.asarray(np.random.default_rng(3).normal(size=shape), dtype)
    fn = jax.jit(lambda a: calibration.calibrate(a, "rms,3", tiles)["absmax"])
    default = np.asarray(fn(x).astype(jnp.float32))
    with numerics.float64_arithmetic(True):
        fn = jax.jit(lambda a: calibration.calibrate(a, "rms,3", tiles)["absmax"])
        route = np.asarray(fn(x).astype(jnp.float32))
    np.testing.assert_array_equal(route.view(np.uint32), default.view(np.uint32))
