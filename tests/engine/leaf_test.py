"""quantize_leaf: same parts as qarray.quantize, one compilation per (shape, dtype, how)."""

from __future__ import annotations

import math
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from jax import monitoring

from qmill.checkpoints.base import dtypes
from qmill.engine import qarray
from qmill.engine.modelfree import layout, leaf

# Recorded by jax once per XLA compilation (jax._src.dispatch.BACKEND_COMPILE_EVENT).
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class _Compilations:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self, event: str, duration: float, **kwargs) -> None:
        del duration, kwargs
        self.count += event == _COMPILE_EVENT

    def __enter__(self) -> _Compilations:
        monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc) -> None:
        monitoring.unregister_event_duration_listener(self)


def _plan(path: str, qtype: str = "int4", **kw) -> layout.LeafPlan:
    return layout.LeafPlan(
        path=path, qtype=qtype, channelwise_axes=(1,), tiled_axes=((0, 16),), **kw
    )


def test_same_shape_dtype_and_how_compile_once_whatever_the_path() -> None:
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((64, 24)).astype(np.float32) for _ in range(4)]
    with _Compilations() as first:
        leaf.quantize_leaf(arrays[0], _plan("layers_0/mlp/kernel", reason="first"))
    assert first.count >= 1  # the listener sees compilations at all
    with _Compilations() as same:
        for i, array in enumerate(arrays[1:], start=1):
            leaf.quantize_leaf(array, _plan(f"layers_{i}/mlp/kernel", reason=f"rule {i}"))
    assert same.count == 0
    with _Compilations() as other:
        leaf.quantize_leaf(arrays[0][:32], _plan("small/kernel"))  # another shape
        leaf.quantize_leaf(arrays[0].astype(jnp.bfloat16), _plan("bf16/kernel"))  # dtype
        leaf.quantize_leaf(arrays[0], _plan("int8/kernel", qtype="int8"))  # how
    assert other.count >= 3


def test_jax_holds_no_host_buffer_once_the_leaf_returns() -> None:
    # Aligned (used in place on CPU) and over HOST_CHECK_MAX values (checked on the device). A
    # reference jaxlib kept until its next garbage collection made the server allocate a third
    # assembly buffer while the first, done with, still looked in use.
    raw = np.empty(512 * 256 * 4 + 64, np.uint8)
    start = -raw.ctypes.data % 64
    array = raw[start : start + 512 * 256 * 4].view(np.float32).reshape(512, 256)
    array[...] = np.random.default_rng(0).standard_normal(array.shape)
    held = sys.getrefcount(raw)
    leaf.quantize_leaf(array, _plan("w", qtype="int8"))
    assert sys.getrefcount(raw) == held


@pytest.mark.parametrize("qtype", ["int4", "nf4", "uint4", "int8", "float8_e4m3fn"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_leaf_parts_equal_quantize(qtype, dtype) -> None:
    x = np.random.default_rng(2).standard_normal((64, 24)).astype(dtype)
    plan = _plan("w", qtype=qtype, scale_dtype="float32")
    result = leaf.quantize_leaf(x, plan)
    how = qarray.HowToQuantize(qtype=qtype, channelwise_axes=(1,), tiled_axes={0: 16})
    q = qarray.quantize(jnp.asarray(x), how, scale_dtype="float32")
    expected = np.asarray(q.qvalue)
    codes = result.codes()
    assert codes.dtype == expected.dtype and codes.shape == expected.shape
    assert codes.tobytes() == expected.tobytes()
    if qtype in ("int4", "nf4", "uint4"):  # packed by the engine as checkpoints store them
        assert result.packed_as == (expected.dtype, expected.shape)
        assert result.qvalue.tobytes() == dtypes.pack_4bit(expected).tobytes()
    else:
        assert result.packed_as is None and result.qvalue is codes
    assert result.scale.dtype == np.float32 and result.scale.tobytes() == q.scale.tobytes()
    assert result.zero_point is None
    x32, deq = x.astype(np.float32), np.asarray(qarray.dequantize(q), np.float32)
    sqnr = 10 * math.log10(np.sum(x32**2) / np.sum((deq - x32) ** 2))
    assert result.quality.sqnr_db == pytest.approx(sqnr, rel=1e-4)


def test_leaf_refuses_nan() -> None:
    x = np.ones((32, 16), np.float32)
    x[3, 4] = np.nan
    with pytest.raises(ValueError, match="w: tensor contains NaN or Inf"):
        leaf.quantize_leaf(x, _plan("w", qtype="int8"))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
@pytest.mark.parametrize("rows", [16, 16 + leaf.HOST_CHECK_MAX // 16])  # host and device check
def test_leaf_refuses_nan_and_inf_on_either_side_of_the_host_check(bad, dtype, rows) -> None:
    x = np.ones((rows, 16), dtype)
    x[rows - 1, 15] = bad
    with pytest.raises(ValueError, match="w: tensor contains NaN or Inf"):
        leaf.quantize_leaf(x, _plan("w", qtype="int8"))
    x[rows - 1, 15] = 2
    assert leaf.quantize_leaf(x, _plan("w", qtype="int8")).scale.shape == (rows // 16, 16)


def test_small_host_tensors_compile_one_function_per_shape() -> None:
    # Their NaN/Inf check runs in numpy: no second compilation for it.
    x = np.random.default_rng(1).standard_normal((48, 24)).astype(np.float32)
    with _Compilations() as compiled:
        leaf.quantize_leaf(x, _plan("w", qtype="int8"))
    assert compiled.count == 1


@pytest.mark.parametrize(
    ("sums", "sqnr_db", "relative_error"),
    [
        ((0.0, 0.0, 0.0, 0.0), math.inf, 0.0),  # zero signal, exact: no noise at all
        ((4.0, 0.0, 1.0, 0.0), math.inf, 0.0),  # exact round trip
        ((0.0, 1.0, 0.0, 0.5), -math.inf, math.inf),  # noise on a zero signal
        ((100.0, 1.0, 2.0, 0.5), 20.0, 0.25),
    ],
)
def test_quality_is_defined_for_zero_signal_and_zero_noise(sums, sqnr_db, relative_error):
    q = leaf.quality(*sums)
    assert q.sqnr_db == pytest.approx(sqnr_db) and q.mean_relative_error == relative_error


def test_measure_on_arrays_agrees_with_the_sums():
    zeros, ones = np.zeros(4, np.float32), np.ones(4, np.float32)
    assert leaf.measure(zeros, zeros) == leaf.Quality(sqnr_db=math.inf, mean_relative_error=0.0)
    assert leaf.measure(zeros, ones) == leaf.Quality(
        sqnr_db=-math.inf, mean_relative_error=math.inf
    )
    x = np.array([1.0, -2.0, 3.0, 0.0], np.float32)
    got = leaf.measure(x, x + np.float32(0.5))
    assert got == leaf.quality(14.0, 1.0, 1.5, 0.5)
    assert got.sqnr_db == pytest.approx(10 * math.log10(14.0))


@pytest.mark.parametrize(
    ("qtype", "channelwise", "tiled", "axis"),
    [("int4", (0,), ((1, 8),), 0), ("int8", (1,), (), 1), ("uint4", (1,), ((0, 16),), 1)],
)
def test_quality_is_measured_on_every_stride_th_scale_block(
    monkeypatch, qtype, channelwise, tiled, axis
) -> None:
    """Large tensors are measured on a sample: whole scale blocks along the axis with the most,
    evenly spread. The figures are those of the sampled blocks, and close to the whole tensor's."""
    monkeypatch.setattr(leaf, "QUALITY_SAMPLE", 256)
    x = np.random.default_rng(3).standard_normal((64, 48)).astype(np.float32)
    plan = layout.LeafPlan(path="w", qtype=qtype, channelwise_axes=channelwise, tiled_axes=tiled)
    result = leaf.quantize_leaf(x, plan)
    assert leaf.quality_stride(x.shape, result.scale.shape) == (axis, 12)
    how = qarray.HowToQuantize(qtype=qtype, channelwise_axes=channelwise, tiled_axes=dict(tiled))
    deq = np.asarray(qarray.dequantize(qarray.quantize(jnp.asarray(x), how)), np.float32)
    blocks = result.scale.shape[axis]
    tile = x.shape[axis] // blocks
    keep = [i for i in range(x.shape[axis]) if (i // tile) % 12 == 0]
    sampled = leaf.measure(np.take(x, keep, axis), np.take(deq, keep, axis))
    assert result.quality.sqnr_db == pytest.approx(sampled.sqnr_db, rel=1e-5)
    assert result.quality.mean_relative_error == pytest.approx(
        sampled.mean_relative_error, rel=1e-5
    )
    assert result.quality.sqnr_db == pytest.approx(leaf.measure(x, deq).sqnr_db, rel=0.1)


def test_small_tensors_are_measured_whole() -> None:
    assert leaf.quality_stride((2047, 1024), (2047, 8)) == (0, 1)
    assert leaf.quality_stride((2048, 1024), (2048, 8)) == (0, 2)
    assert leaf.quality_stride((4096, 4096), (4096, 32)) == (0, 16)
    assert leaf.quality_stride((4096, 4096), (1, 4096)) == (1, 16)
    assert leaf.quality_stride((4096, 4096), (1, 1)) == (0, 1)
    assert leaf.quality_stride((), ()) == (0, 1)
