"""The engine's fast formulations give exactly what the plain ones give (issue #2).

Each fast path (binary-search nf4 codes, 4-bit codes as bytes, regrouped max reductions) is
checked against the straightforward formulation it replaces, bit for bit, on inputs chosen to hit
the edge cases: every bf16 value for nf4, signed zeros, NaN/Inf, odd and chunked axis lengths.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qmill.engine import numerics, qarray, qtypes, tiling
from qmill.engine.core import qcodes


def _nf4_argmin(y: np.ndarray) -> np.ndarray:
    """Nearest of the 16 levels with float32 distances, ties to the lower index
    (docs/numerics-spec.md)."""
    levels = np.asarray(qtypes.NF4_LEVELS, np.float32)
    return np.argmin(np.abs(y[:, None] - levels[None, :]), axis=1).astype(np.uint8)


def test_nf4_search_equals_argmin_on_every_bf16_value_and_near_thresholds() -> None:
    every_bf16 = np.arange(2**16, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    every_bf16 = every_bf16[np.isfinite(every_bf16) & (np.abs(every_bf16) <= 1.5)]
    near = []
    for t in qcodes._nf4_thresholds():
        v = t
        for _ in range(4):
            v = np.nextafter(v, np.float32(-2))
        for _ in range(9):
            near.append(v)
            v = np.nextafter(v, np.float32(2))
    y = np.concatenate([every_bf16, np.asarray(near, np.float32)])
    expected = _nf4_argmin(y)
    search = np.asarray(jax.jit(qcodes._nf4_codes)(jnp.asarray(y)))
    count = np.asarray(jax.jit(qcodes._nf4_count)(jnp.asarray(y)))
    np.testing.assert_array_equal(search, expected)
    np.testing.assert_array_equal(count, expected)


@pytest.mark.parametrize("qtype", ["int4", "int3", "uint4", "nf4", "int8", "float8_e4m3fn"])
def test_codes_as_bytes_view_as_the_storage_dtype(qtype: str) -> None:
    y = jnp.asarray(np.linspace(-9.5, 9.5, 77, dtype=np.float32))
    qt = qtypes.get(qtype)
    if qt.kind == qtypes.LOOKUP:
        y = y / 9.5
    native = np.asarray(qcodes.to_qtype(y, qt))
    as_bytes = np.asarray(qcodes.to_qtype(y, qt, as_bytes=True))
    assert as_bytes.dtype == qcodes.byte_dtype(qt)
    viewed = qarray.storage_view(as_bytes, qt.name)
    assert viewed.dtype == native.dtype
    # The same bytes numpy holds for the storage dtype, not only the same values.
    np.testing.assert_array_equal(viewed.view(np.uint8), native.view(np.uint8))
    np.testing.assert_array_equal(
        np.asarray(qcodes.from_bytes(jnp.asarray(as_bytes), qt)),
        native.astype(np.int32) if qt.kind != qtypes.FLOAT else native,
    )


_LAYOUTS = [
    ((1,), {}),
    ((0,), {}),
    ((), {}),
    ((1,), {0: 16}),
    ((0,), {1: 16}),
    ((), {0: 8, 1: 16}),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("shape", [(64, 48), (96, 7), (6, 160)])
def test_max_abs_tiles_equals_max_of_abs(dtype, shape) -> None:
    rng = np.random.default_rng(sum(shape))
    x = jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    # Signed zeros: a whole row, a whole column and scattered.
    x = x.at[2].set(-0.0).at[:, 1].set(-0.0).at[5, 3].set(0.0)
    for channelwise, tiled in _LAYOUTS:
        tiled = {a: t for a, t in tiled.items() if shape[a] % t == 0}
        tiles = tiling.resolve_tiles(shape, channelwise, tiled)
        expected = tiling.reduce_tiles(jnp.abs(x), tiles, jnp.max)
        got = tiling.max_abs_tiles(x, tiles, numerics.widen).astype(dtype)
        assert got.shape == expected.shape
        bits = np.uint16 if jnp.dtype(dtype).itemsize == 2 else np.uint32
        np.testing.assert_array_equal(np.asarray(got).view(bits), np.asarray(expected).view(bits))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_reach_their_tiles_scale(dtype, bad) -> None:
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 48)), dtype)
    x = x.at[37, 21].set(bad)
    for channelwise, tiled in _LAYOUTS:
        how = qarray.HowToQuantize(qtype="int8", channelwise_axes=channelwise, tiled_axes=tiled)
        scale = np.asarray(jax.jit(functools.partial(qarray.quantize, how=how))(x).scale)
        tiles = tiling.resolve_tiles(x.shape, channelwise, tiled)
        bad_tile = (37 // tiles[0], 21 // tiles[1])
        finite = np.isfinite(scale.astype(np.float32))
        assert not finite[bad_tile], (channelwise, tiled)
        assert finite.sum() == finite.size - 1, (channelwise, tiled)
        with pytest.raises(ValueError, match="NaN or Inf"):
            qarray.quantize(x, how)


_BYTES_CASES = [
    ("int4", (1,), {0: 16}, "absmax"),
    ("int4", (0,), {1: 16}, "minmax"),
    ("uint4", (1,), {}, "absmax"),
    ("int2", (0,), {}, "absmax"),
    ("nf4", (1,), {0: 32}, "absmax,0.9"),
    ("int8", (0,), {}, "rms,3"),
    ("float8_e4m3fn", (1,), {}, "absmax"),
]


@pytest.mark.parametrize(("qtype", "channelwise", "tiled", "method"), _BYTES_CASES)
def test_quantize_bytes_equals_quantize(qtype, channelwise, tiled, method) -> None:
    x = jnp.asarray(np.random.default_rng(1).standard_normal((64, 96)), jnp.bfloat16)
    how = qarray.HowToQuantize(
        qtype=qtype, channelwise_axes=channelwise, tiled_axes=tiled, calibration_method=method
    )
    q = qarray.quantize(x, how, scale_dtype="float32")
    codes, scale, zero_point = jax.jit(
        functools.partial(qarray.quantize_bytes, how=how, scale_dtype="float32")
    )(x)
    qvalue = qarray.storage_view(np.asarray(codes), qtype)
    assert qvalue.dtype == np.asarray(q.qvalue).dtype
    np.testing.assert_array_equal(qvalue.view(np.uint8), np.asarray(q.qvalue).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scale), np.asarray(q.scale))
    assert (zero_point is None) == (q.zero_point is None)
    if zero_point is not None:
        np.testing.assert_array_equal(np.asarray(zero_point), np.asarray(q.zero_point))
    deq = qarray.dequantize_bytes(codes, qtype, scale, zero_point)
    np.testing.assert_array_equal(np.asarray(deq), np.asarray(qarray.dequantize(q)))


@pytest.mark.parametrize(("qtype", "channelwise", "tiled", "method"), _BYTES_CASES)
def test_eager_quantize_equals_traced_quantize(qtype, channelwise, tiled, method) -> None:
    # Eagerly on the CPU, 4-bit codes are packed by numpy (qarray._packs_on_host); under a trace
    # XLA packs them, and a concrete array closed over in jit takes the eager entry but traced.
    x = jnp.asarray(np.random.default_rng(2).standard_normal((64, 96)), jnp.float32)
    how = qarray.HowToQuantize(
        qtype=qtype, channelwise_axes=channelwise, tiled_axes=tiled, calibration_method=method
    )
    eager = qarray.quantize(x, how)
    traced = jax.jit(lambda a: qarray.quantize(a, how))(x)
    others = [traced]
    if not method.startswith("rms"):
        # A closed-over array is a constant: XLA folds the whole quantization at compile time
        # with its HLO evaluator, whose sums (rms) add in another order than compiled code.
        others.append(jax.jit(lambda: qarray.quantize(x, how))())
    for other in others:
        assert eager.qvalue.dtype == other.qvalue.dtype == qtypes.get(qtype).storage
        np.testing.assert_array_equal(
            np.asarray(eager.qvalue).view(np.uint8), np.asarray(other.qvalue).view(np.uint8)
        )
        np.testing.assert_array_equal(np.asarray(eager.scale), np.asarray(other.scale))
        assert (eager.zero_point is None) == (other.zero_point is None)
        if eager.zero_point is not None:
            np.testing.assert_array_equal(eager.zero_point, other.zero_point)
    assert eager.qvalue.sharding == x.sharding
    assert eager.qvalue.committed == x.committed == traced.qvalue.committed
    on_cpu0 = jax.device_put(x, jax.devices("cpu")[0])
    assert qarray.quantize(on_cpu0, how).qvalue.committed
    with pytest.raises(ValueError, match="NaN or Inf"):
        qarray.quantize(x.at[3, 5].set(jnp.nan), how)
