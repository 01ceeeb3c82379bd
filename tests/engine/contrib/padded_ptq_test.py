"""Padded PTQ gives the reference's (qwix 0.1.8) results: codes and scales bit for bit, outputs
within a relative 1e-5 (XLA:CPU's dot kernels, see contrib_golden_test.py).

The expected values were recorded by make_padded_golden.py from the reference on contrib_cases'
padded inputs (a contracted axis of 40 in tiles of 16 or 32).
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import qmill.engine as qe
from qmill.engine.contrib import padded_ptq
from qmill.engine.ops import einsum as einsum_ops
from tests.engine.contrib.contrib_cases import PAD_CASES, bits, codes, padded_inputs
from tests.engine.contrib.contrib_golden_test import _close

GOLDEN = np.load(pathlib.Path(__file__).parent / "golden" / "padded_ptq.npz")
X, W = (jnp.asarray(a) for a in padded_inputs())
HOW_2D = qe.HowToQuantize(qtype="int8", channelwise_axes=(2,), tiled_axes={0: 2, 1: 16})


class Einsum(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.einsum("td,edf->tef", x, self.param("w", lambda *_: W, W.shape))


class Dot(nn.Module):
    @nn.compact
    def __call__(self, x):
        kernel = self.param("w", lambda *_: W, W.shape)
        return jax.lax.dot_general(x, kernel, (([1], [1]), ([], [])))


def test_quantize_pads_to_whole_tiles_as_the_reference() -> None:
    q = padded_ptq.quantize(W, HOW_2D)
    assert isinstance(q, padded_ptq.PaddedQArray)
    assert q.padded_shape == tuple(GOLDEN["q2d_padded_shape"]) == (4, 48, 8)
    assert q.original_shape == q.shape == W.shape
    np.testing.assert_array_equal(codes(q), GOLDEN["q2d_qvalue"])
    np.testing.assert_array_equal(bits(q.scale), GOLDEN["q2d_scale"])
    np.testing.assert_array_equal(bits(padded_ptq.dequantize(q)), GOLDEN["q2d_dequantized"])


def test_keep_padded_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(padded_ptq, "QARRAY_KEEP_PADDED_SHAPE", True)
    q = padded_ptq.quantize(W, HOW_2D)
    np.testing.assert_array_equal(codes(q), GOLDEN["q2d_kept_qvalue"])
    np.testing.assert_array_equal(bits(padded_ptq.dequantize(q)), GOLDEN["q2d_dequantized"])


@pytest.mark.parametrize(("name", "weight_qtype", "act_qtype", "tile"), PAD_CASES)
def test_provider_matches_the_reference(name, weight_qtype, act_qtype, tile) -> None:
    rule = qe.QuantizationRule(
        module_path=".*", weight_qtype=weight_qtype, act_qtype=act_qtype, tile_size=tile
    )
    for kind, model in (("einsum", Einsum()), ("dot", Dot())):
        qmodel = qe.quantize_model(model, padded_ptq.PaddedPtqProvider([rule]))
        variables = qmodel.init(jax.random.key(0), X)
        kernel = variables["params"]["w"].array
        np.testing.assert_array_equal(codes(kernel), GOLDEN[f"{name}_qvalue"])
        np.testing.assert_array_equal(bits(kernel.scale), GOLDEN[f"{name}_scale"])
        _close(qmodel.apply(variables, X), GOLDEN[f"{name}_{kind}_y"])
        abstract = jax.eval_shape(qmodel.init, jax.random.key(0), X)["params"]
        params = padded_ptq.quantize_params({"w": W}, abstract)
        np.testing.assert_array_equal(codes(params["w"].array), GOLDEN[f"{name}_qvalue"])


def test_padded_lhs_against_a_float_rhs() -> None:
    """A padded QArray on the left, the float operand padded to it on its contracted axis."""
    how = einsum_ops.get_how_to_quantize(
        einsum_str="edf,td->tef", ndims=(3, 2), for_lhs=True, qtype="int8", tile_size=16
    )
    q = padded_ptq.quantize(W, how)
    want = jnp.einsum("edf,td->tef", padded_ptq.dequantize(q), X)
    np.testing.assert_allclose(padded_ptq.einsum("edf,td->tef", q, X), want, rtol=1e-5, atol=1e-5)
    got = padded_ptq.dot_general(q, X, (([1], [1]), ([], [])))
    assert got.shape == (3, 8, 4)
    np.testing.assert_allclose(got, want.transpose(1, 2, 0), rtol=1e-5, atol=1e-5)


def test_padded_shapes() -> None:
    assert padded_ptq.get_padded_shape((3, 40, 8), {1: 16}) == (3, 48, 8)
    assert padded_ptq.get_padded_shape((3, 40, 8), {1: 0.3}) == (3, 48, 8)  # tile round(12)
    assert padded_ptq.get_padded_shape((3, 40, 8), {}) == (3, 40, 8)
    assert padded_ptq.pad_to_shape(jnp.ones((2, 3)), (2, 5)).sum() == 6


def test_quantize_act_takes_the_reference_arguments() -> None:
    """quantize_act(array, how, rule, act_name), as the reference's ptq and padded_ptq take it:
    outside a module the scale is dynamic, and the padded codes are PTQ's on the padded array."""
    from qmill.engine.providers import ptq

    rule = qe.QuantizationRule(module_path=".*", weight_qtype="int8", tile_size=16)
    how = einsum_ops.get_how_to_quantize(
        einsum_str="td,edf->tef", ndims=(2, 3), for_lhs=False, qtype="int8", tile_size=16
    )
    padded = padded_ptq.quantize_act(W, how, rule, None)
    w_padded = padded_ptq.pad_to_shape(W, padded.padded_shape)
    plain = ptq.quantize_act(w_padded, how, rule, None)
    np.testing.assert_array_equal(codes(plain), codes(qe.qarray.quantize(w_padded, how)))
    np.testing.assert_array_equal(codes(padded), codes(plain)[:, : W.shape[1], :])
    np.testing.assert_array_equal(bits(padded.scale), bits(plain.scale))
