"""Core names of the reference's public API: qtype equality, averaging, bounds, qarray helpers,
mx/nv tile refusals."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import qmill.engine
from qmill.engine import averaging, numerics, qarray
from tests import random_inputs

X = random_inputs.normal(jax.random.key(0), (4, 64), jnp.float32)


def _q(x, qtype="int8", **how):
    return qarray.quantize(x, qarray.HowToQuantize(qtype=qtype, **how))


def test_qtypes_compare_equal_to_their_dtypes() -> None:
    q = _q(X, jnp.int8, channelwise_axes=(0,))
    assert q.qtype == jnp.int8 and jnp.int8 == q.qtype and q.qtype == "int8"
    assert q.qtype != jnp.int4 and q.qtype != jnp.float32 and q.qtype != None  # noqa: E711
    assert qarray.HowToQuantize(qtype="float8_e4m3fn").qtype == jnp.float8_e4m3fn
    assert qarray.HowToQuantize(qtype=jnp.int4).qtype == np.dtype(jnp.int4)
    # Still a string where one is expected: hashing, dict keys, jit static fields.
    assert {q.qtype: 1}["int8"] == 1 and isinstance(q.qtype, str)
    jitted = jax.jit(lambda x: _q(x, "int4", channelwise_axes=(0,)))(X)
    assert jitted.qtype == jnp.int4


def test_simple_moving_average_bootstraps_with_the_default() -> None:
    sma = averaging.SimpleMovingAverage(bootstrap_steps=2)
    stat = sma.init({"absmax": jnp.zeros((2,))})
    batches = [jnp.array([1.0, 2.0]), jnp.array([3.0, 6.0]), jnp.array([5.0, 10.0])]
    for i, value in enumerate(batches, start=1):
        stat = sma.update(stat, {"absmax": value})
        got = sma.get_calibration(stat, {"absmax": value})["absmax"]
        # count ≤ bootstrap_steps: the default (this batch's own); then the running mean.
        expected = value if i <= 2 else jnp.mean(jnp.stack(batches), axis=0)
        np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(sma.get_calibration(stat)["absmax"], [3.0, 6.0])
    with pytest.raises(ValueError, match="shape"):
        sma.update(stat, {"absmax": jnp.zeros((3,))})
    assert averaging.SimpleMovingAverage().bootstrap_steps == 0
    for wrong in ({"absmax": batches[0], "extra": batches[0]}, {"min": batches[0]}):
        with pytest.raises(ValueError, match="default_calibration has keys"):
            sma.get_calibration(stat, wrong)


@pytest.mark.parametrize(
    ("qtype", "bound"),
    [
        ("int8", 127.5),
        (jnp.int4, 7.5),
        ("int3", 3.5),
        ("nf4", 1.0),
        ("mxfp8", 448.0),
        ("nvfp4", 6.0),
        (jnp.int16, 32768.0),
        ("uint8", 255.5),
    ],
)
def test_symmetric_bound(qtype, bound) -> None:
    assert numerics.get_symmetric_bound(qtype) == bound


def test_asymmetric_bound_and_refusals() -> None:
    assert numerics.get_asymmetric_bound(jnp.int8) == (-128.0, 127.0)
    assert numerics.get_asymmetric_bound("int4") == (-8.0, 7.0)
    assert numerics.get_asymmetric_bound("int16") == (-32768.0, 32767.0)
    with pytest.raises(ValueError, match="doesn't support asymmetric"):
        numerics.get_asymmetric_bound("nf4")
    with pytest.raises(ValueError, match="bfloat16"):
        numerics.get_symmetric_bound(jnp.bfloat16)
    assert numerics.should_quantize(jnp.bfloat16) and not numerics.should_quantize(jnp.int8)


def test_get_tiled_axes() -> None:
    assert qarray.get_tiled_axes(_q(X, channelwise_axes=(0,), tiled_axes={1: 16})) == {1: 16}
    assert qarray.get_tiled_axes(_q(X, channelwise_axes=(0,))) == {}
    assert qarray.get_tiled_axes(_q(X, tiled_axes={0: 2, 1: 32})) == {0: 2, 1: 32}


def test_broadcast_to_commutes_with_dequantize() -> None:
    q = _q(X[:1], channelwise_axes=(0,), tiled_axes={1: 16})
    b = qarray.broadcast_to(q, (3, 2, 64))
    assert b.shape == (3, 2, 64) and b.qtype == q.qtype
    np.testing.assert_array_equal(
        qarray.dequantize(b), jnp.broadcast_to(qarray.dequantize(q), (3, 2, 64))
    )
    assert qarray.broadcast_to(q, (1, 64)) is q
    np.testing.assert_array_equal(qarray.broadcast_to(X[:1], (2, 64)), jnp.tile(X[:1], (2, 1)))
    with pytest.raises(ValueError, match="cannot broadcast"):
        qarray.broadcast_to(q, (2, 32))


def test_clip_gradient_to_calibration() -> None:
    x = jnp.array([[-3.0, -1.0, 0.5, 2.0]])
    g = jnp.ones_like(x)
    calib = {"absmax": jnp.array([[1.5]])}
    # Plain absmax covers all of the data it came from: the gradient passes untouched.
    assert qarray.clip_gradient_to_calibration(g, x, calib, "absmax") is g
    out = qarray.clip_gradient_to_calibration(g, x, calib, "absmax,0.5")
    np.testing.assert_array_equal(out, [[0.0, 1.0, 1.0, 0.0]])
    minmax = {"min": jnp.array([[-1.0, 0.0]]), "max": jnp.array([[1.0, 1.0]])}  # 2 tiles of 2
    out = qarray.clip_gradient_to_calibration(g, x, minmax, "fixed,-1,1")
    np.testing.assert_array_equal(out, [[0.0, 1.0, 1.0, 0.0]])
    np.testing.assert_array_equal(
        qarray.clip_to_calibration(x, minmax, {1: 2}), [[-1.0, -1.0, 0.5, 1.0]]
    )


@pytest.mark.parametrize(
    ("qtype", "tiled", "error"),
    [
        ("mxfp8", {}, "Format mxfp8 requires `tiled_axes` to be specified"),
        ("mxfp8", {1: 16}, "Format mxfp8 requires a tile size of 32, but axis 1 got 16"),
        ("mxfp8", {1: 64}, "Format mxfp8 requires a tile size of 32, but axis 1 got 64"),
        ("mxfp4", {1: 16}, "Format mxfp4 requires a tile size of 32"),
        ("mxfp8_16", {1: 32}, "Format mxfp8_16 requires a tile size of 16, but axis 1 got 32"),
        ("nvfp4", {}, "Format nvfp4 requires `tiled_axes` to be specified"),
        ("nvfp4", {1: 32}, "Format nvfp4 requires a tile size of 16, but axis 1 got 32"),
    ],
)
def test_mx_and_nv_formats_refuse_other_tiles_at_construction(qtype, tiled, error) -> None:
    with pytest.raises(ValueError, match=error):
        qarray.HowToQuantize(qtype=qtype, tiled_axes=tiled)


def test_mx_and_nv_formats_accept_their_tile() -> None:
    for qtype, tile in [("mxfp8", 32), ("mxfp4", 32), ("mxfp8_16", 16), ("nvfp4", 16)]:
        q = _q(X, qtype, channelwise_axes=(0,), tiled_axes={1: tile})
        assert q.scale.shape == (4, 64 // tile)
    # A float tile is a fraction of the axis: only checkable against a shape.
    how = qarray.HowToQuantize(qtype="mxfp8", channelwise_axes=(0,), tiled_axes={1: 0.25})
    with pytest.raises(ValueError, match="requires a tile size of 32, but axis 1 got 16"):
        qarray.quantize(X, how)


def test_top_level_names() -> None:
    import qmill.engine as qe
    from qmill.engine import ops

    assert qe.einsum is ops.einsum.einsum and qe.dot_general is ops.dot_general.dot_general
    assert (
        qe.dot is ops.dot.dot and qe.conv_general_dilated is ops.conv_general.conv_general_dilated
    )
    assert qe.ragged_dot is ops.ragged_dot.ragged_dot
    assert qe.ragged_dot_general is ops.ragged_dot.ragged_dot_general
    assert qe.contrib.gptq.GptqRule and qe.sparsity.get_sparsity_mask
    out = qe.einsum("...ab,...bc->...ac", jnp.ones((2, 3, 4)), jnp.ones((4, 5)))
    assert out.shape == (2, 3, 5)


def _type_checking_imports() -> dict[str, tuple[str, str]]:
    """{public name: (module, attribute)} of engine/__init__.py's `if TYPE_CHECKING:` block."""
    tree = ast.parse(pathlib.Path(qmill.engine.__file__).read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If))
    return {alias.asname: (node.module, alias.name) for node in block.body for alias in node.names}


def test_every_public_name_is_the_object_its_module_defines() -> None:
    # The lazy surface (PEP 562) gives what the eager `from M import N as A` lines gave; the
    # TYPE_CHECKING block (for type checkers), _PUBLIC (for __getattr__) and __all__ agree.
    eager = _type_checking_imports()
    assert set(eager) == set(qmill.engine.__all__) == set(qmill.engine._PUBLIC)
    for name, (module, attribute) in eager.items():
        found: dict = {}
        exec(f"from {module} import {attribute} as expected", found)
        expected = found["expected"]
        assert getattr(qmill.engine, name) is expected, name
    assert set(qmill.engine.__all__) <= set(dir(qmill.engine))
    namespace: dict = {}
    exec("from qmill.engine import *", namespace)
    assert {n for n in namespace if not n.startswith("__")} == set(qmill.engine.__all__)
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        qmill.engine.nothing  # noqa: B018


def test_importing_the_engine_imports_no_room() -> None:
    # Each name is imported on first use; the rooms stay attributes (qwix.ops, qwix.providers).
    code = (
        "import sys, qmill.engine as qwix; "
        "assert 'jax' not in sys.modules; "
        "assert not [m for m in sys.modules if m.startswith('qmill.engine.')]; "
        "assert qwix.PtqProvider is qwix.providers.ptq.PtqProvider and 'flax.nnx' in sys.modules; "
        "assert qwix.dot is qwix.ops.dot.dot"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_broadcast_to_repeats_entries_over_dividing_axes() -> None:
    x = jnp.arange(8.0)
    q = qarray.quantize_api(x, jnp.int8, channelwise_axes=[0])
    b = qarray.broadcast_to(q, (64,))
    assert b.shape == (64,) and b.scale.shape == (64,)
    np.testing.assert_array_equal(qarray.dequantize(b), jnp.repeat(qarray.dequantize(q), 8))
    np.testing.assert_array_equal(
        qarray.broadcast_to(jnp.arange(4.0)[None], (2, 4))[1], jnp.arange(4.0)
    )


@pytest.mark.parametrize(
    ("method", "noop"),
    [
        ("absmax", True),
        ("absmax,1.2", True),
        ("absmax,0.9", False),
        ("minmax,1.0", True),
        ("minmax,0.8", False),
        ("fixed,1.0", False),
        ("rms,1.0", False),
    ],
)
def test_is_gradient_clipping_noop(method, noop) -> None:
    assert qarray.is_gradient_clipping_noop(method) is noop


def test_clip_gradient_tiles_one_dimensional() -> None:
    x = jnp.array([10.0, 10.0, 2.0, 2.0])
    out = qarray.clip_gradient_to_calibration(
        jnp.ones_like(x), x, {"absmax": jnp.array([2.5, 2.5])}, "absmax,0.5"
    )
    np.testing.assert_array_equal(out, [0.0, 0.0, 1.0, 1.0])


def test_sparsify_with_a_sparsity_rule() -> None:
    from qmill.engine import sparsity

    x = jnp.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    rule = sparsity.SparsityRule(
        weight_sparsity_n=2, weight_sparsity_m=4, weight_sparsity_order="R"
    )
    np.testing.assert_array_equal(qarray.sparsify(x, rule), [[0, 0, 3, 4], [0, 0, 7, 8]])
    assert qarray.sparsify(x, sparsity.SparsityRule()) is x  # m = 0: sparsity off


def test_how_to_quantize_axes_read_as_the_reference_writes_them() -> None:
    how = qarray.HowToQuantize(qtype="mxfp8", channelwise_axes=[0, 1], tiled_axes={3: 32})
    assert how.tiled_axes == {3: 32} and how.tiled_axes[3] == 32 and 3 in how.tiled_axes
    assert how.tiled_axes.get(1, 1) == 1 and dict(how.tiled_axes) == {3: 32}
    assert how.tiled_axes == ((3, 32),) and list(how.tiled_axes) == [(3, 32)]
    assert how.channelwise_axes == [0, 1] and how.channelwise_axes == (0, 1)
    assert how.tiled_axes != {3: 16} and how.channelwise_axes != [1]
    same = qarray.HowToQuantize(qtype="mxfp8", channelwise_axes=(0, 1), tiled_axes=((3, 32),))
    assert how == same and hash(how) == hash(same)  # still one static jit key


def test_numerics_conversions() -> None:
    x = jnp.array([-200.0, -1.5, -0.5, 0.5, 1.5, 2.6, 300.0])
    np.testing.assert_array_equal(numerics.convert_to(x, jnp.int8), [-128, -2, 0, 0, 2, 3, 127])
    assert numerics.convert_to(x, "int4").dtype == jnp.int4
    fp8 = numerics.convert_to(jnp.array([1000.0, 1.0]), jnp.float8_e4m3fn)
    np.testing.assert_array_equal(fp8.astype(jnp.float32), [448.0, 1.0])  # clipped, not inf
    # Noise of +0.49 lifts 0.5 (which rounds to even 0) to 1.
    noisy = numerics.convert_to(jnp.array([0.5]), jnp.int8, noise_fn=lambda s: jnp.full(s, 0.49))
    assert int(noisy[0]) == 1
    codes = numerics.convert_to(jnp.array([-1.0, 0.0, 0.3, 1.0]), "nf4")
    np.testing.assert_array_equal(
        numerics.convert_from(codes, "nf4"), numerics.get_nf4_buckets()[jnp.array([0, 7, 11, 15])]
    )
    assert numerics.convert_from(x, jnp.int8) is x
    assert numerics.can_dequant_on_output(jnp.int8) and not numerics.can_dequant_on_output("nf4")
    assert numerics.get_nf4_buckets().shape == (16,)
