"""Reference behaviours of the providers (issue 30): jnp.asarray of quantized weights inside a
PTQ model, mx formats in QT / PTQ without an explicit tile, and the mx dot on the reference's
inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import qmill.engine as qwix
from qmill.engine import qarray
from qmill.engine.ops import mxfp_dot
from tests import random_inputs

DN = (((1,), (0,)), ((), ()))
X = jnp.ones((2, 4))
RULES = [qwix.QuantizationRule(weight_qtype="int8")]


class Spy(qwix.PtqProvider):
    """Records what reaches the quantized dot as its rhs."""

    def __init__(self, rules):
        super().__init__(rules)
        self.seen = []

    def quantized_dot_general(self, rule, op_id, module, lhs, rhs, dimension_numbers):
        self.seen.append(type(rhs).__name__)
        return super().quantized_dot_general(rule, op_id, module, lhs, rhs, dimension_numbers)


class LinenAsarray(nn.Module):
    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (4, 3))
        return jax.lax.dot_general(x, jnp.asarray(kernel, jnp.float32), DN)


class NnxAsarray(nnx.Module):
    def __init__(self):
        self.kernel = nnx.Param(random_inputs.normal(jax.random.key(0), (4, 3)))

    def __call__(self, x):
        return jax.lax.dot_general(x, jnp.asarray(self.kernel), DN)


def test_asarray_of_a_quantized_weight_stays_quantized_linen():
    spy = Spy(RULES)
    model = qwix.quantize_model(LinenAsarray(), spy)
    variables = model.init(jax.random.key(0), X)  # the float param: quantized on first use
    kernel = variables["params"]["kernel"]
    assert isinstance(kernel, qwix.WithAux)
    out = model.apply(variables, X)  # now jnp.asarray meets the WithAux: it must stay one
    assert spy.seen[-1] == "WithAux"
    np.testing.assert_allclose(out, X @ qwix.dequantize(kernel.array), rtol=1e-6)


def test_asarray_of_a_quantized_weight_stays_quantized_nnx():
    spy = Spy(RULES)
    model = qwix.quantize_model(NnxAsarray(), spy, X)
    assert isinstance(model.kernel.array, qarray.QArray)
    model(X)
    assert spy.seen[-1] == "WithAux"
    # The provider's own asarray, as the reference's: WithAux / QArray pass, a dtype casts scales.
    with_aux = nnx.to_pure_dict(nnx.state(model))
    assert set(with_aux["kernel"]["array"]) == {"qvalue", "scale"}
    qa = qwix.quantize(jnp.ones((4, 3)), "int8")
    assert spy.asarray(qa) is qa
    assert spy.asarray(qa, jnp.bfloat16).scale.dtype == jnp.bfloat16
    np.testing.assert_array_equal(spy.asarray(jnp.ones(2)), jnp.ones(2))
    # A quantized weight's NNX state ({"array": {"qvalue", "scale"}}) becomes its QArray.
    from_state = spy.asarray(nnx.state(model)["kernel"])
    assert isinstance(from_state, qarray.QArray)
    np.testing.assert_array_equal(from_state.qvalue, model.kernel.array.qvalue[...])


@pytest.mark.parametrize("fmt", ["mxfp4", "mxfp8", "nvfp4"])
def test_mx_formats_need_no_explicit_tile(fmt):
    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, use_bias=False)(x)

    x = random_inputs.normal(jax.random.key(1), (2, 64))
    qt = qwix.quantize_model(Dense(), qwix.QtProvider([qwix.QtRule(weight_qtype=fmt)]))
    assert qt.apply(qt.init(jax.random.key(0), x), x).shape == (2, 8)
    ptq = qwix.quantize_model(Dense(), qwix.PtqProvider([qwix.QuantizationRule(weight_qtype=fmt)]))
    kernel = ptq.init(jax.random.key(0), x)["params"]["Dense_0"]["kernel"].array
    # Blocks of the format's size along the contracted axis (64 / 32 or 64 / 16).
    tile = 16 if fmt == "nvfp4" else 32
    assert kernel.scale.shape == (64 // tile, 8)


def test_mx_dot_on_the_reference_inputs():
    # The reference's inputs: float32 ones on the mxfp8 grid, one block of 32 per row.
    ones = qarray.QArray(qvalue=jnp.ones((2, 32)), scale=jnp.ones((2, 1)), qtype="mxfp8")
    out = mxfp_dot.block_scaled_dot_general(ones, ones, dimension_numbers=(((1,), (1,)), ((), ())))
    np.testing.assert_array_equal(out, jnp.full((2, 2), 32.0))
    one_side = mxfp_dot.block_scaled_dot_general(ones, jnp.ones((2, 32)), (((1,), (1,)), ((), ())))
    assert one_side is None


def test_asarray_of_a_qarray_inside_a_ptq_model_stays_a_qarray():
    # Model code that takes the QArray out of its quantized weight and calls jnp.asarray on it.
    seen = []

    class QArrayAsarray(nnx.Module):
        def __init__(self):
            self.kernel = nnx.Param(random_inputs.normal(jax.random.key(0), (4, 3)))

        def __call__(self, x):
            inner = getattr(self.kernel, "array", None)
            w = jnp.asarray(inner if isinstance(inner, qarray.QArray) else self.kernel)
            seen.append(type(w).__name__)
            return jax.lax.dot_general(x, w, DN)

    spy = Spy(RULES)
    model = qwix.quantize_model(QArrayAsarray(), spy, X)
    out = model(X)
    assert seen[-1] == "QArray" and spy.seen[-1] == "QArray"
    np.testing.assert_allclose(out, X @ qwix.dequantize(model.kernel.array), rtol=1e-6)


def test_mx_dot_on_the_reference_batched_and_broadcast_shapes():
    def mx(shape, scale_shape, scale):
        qvalue = jnp.ones(shape, jnp.float8_e4m3fn)
        return qarray.QArray(qvalue=qvalue, scale=jnp.full(scale_shape, scale), qtype="mxfp8")

    # Two batch axes, flattened and restored: (2, 3, 4, 32) · (2, 3, 6, 32) -> (2, 3, 4, 6).
    dims = (((3,), (3,)), ((0, 1), (0, 1)))
    out = mxfp_dot.block_scaled_dot_general(
        mx((2, 3, 4, 32), (2, 3, 4, 1), 2.0), mx((2, 3, 6, 32), (2, 3, 6, 1), 0.5), dims
    )
    np.testing.assert_array_equal(out, jnp.full((2, 3, 4, 6), 32.0))
    # A scale broadcast along the batch axis ((1, 4, 1) for (2, 4, 32)).
    dims = (((2,), (2,)), ((0,), (0,)))
    out = mxfp_dot.block_scaled_dot_general(
        mx((2, 4, 32), (1, 4, 1), 2.0), mx((2, 6, 32), (2, 6, 1), 1.0), dims
    )
    np.testing.assert_array_equal(out, jnp.full((2, 4, 6), 64.0))


# ---- issue 40: the reference's ptq_test asarray cases ------------------------------------------


def _asarray_model():
    class AsArrayModule(nnx.Module):
        def __call__(self, x, dtype=None):
            return jnp.asarray(x, dtype=dtype)

    return qwix.quantize_model(AsArrayModule(), qwix.PtqProvider(RULES), jnp.ones((2, 2)))


def test_asarray_of_with_aux_keeps_it_and_casts_it():
    # The reference's test_asarray_interception_with_aux.
    model = _asarray_model()
    wa = qwix.WithAux(jnp.ones((2, 2)), qwix.HowToQuantize(qtype="int8"))
    assert jax.tree.map(id, model(wa)) == jax.tree.map(id, wa)
    f16 = model(wa, dtype=jnp.float16)
    assert isinstance(f16, qwix.WithAux) and f16.dtype == jnp.float16
    assert (wa.shape, wa.ndim, wa.dtype) == ((2, 2), 2, jnp.float32)
    # astype keeps the box (the axis names) of the array.
    boxed = qwix.WithAux(nn.Partitioned(jnp.ones((2, 2)), names=("a", "b")), wa.how)
    cast = boxed.astype(jnp.float16)
    assert cast.dtype == jnp.float16 and isinstance(cast.array, nn.Partitioned)
    assert cast.array.names == ("a", "b")
    # and casts a QArray's scale.
    qa = qwix.WithAux(qwix.quantize(jnp.ones((4, 3)), "int8"), wa.how).astype(jnp.bfloat16)
    assert isinstance(qa.array, qarray.QArray) and qa.array.scale.dtype == jnp.bfloat16


def test_asarray_of_a_float_lhs_param_falls_back_in_a_linen_model():
    # The reference's test_asarray_interception_linen_module: params "quantized" against their
    # own float shapes stay float; jnp.asarray(w) @ x then computes in float (the reference's
    # PTQ never takes an lhs for a weight) instead of asking for quantize_params.
    class LinenAsArrayModule(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.ones, (2, 2))
            return jnp.asarray(w) @ x

    model = LinenAsArrayModule()
    variables = model.init(jax.random.key(0), jnp.ones((2, 2)))
    q_vars = qwix.quantize_params(variables, jax.eval_shape(lambda: variables))
    out = qwix.quantize_model(model, qwix.PtqProvider(RULES)).apply(q_vars, jnp.ones((2, 2)))
    np.testing.assert_array_equal(out, jnp.full((2, 2), 2.0))


def test_a_float_rhs_param_still_needs_quantize_params():
    # As the reference (ptq_test.test_nn_ptq): an rhs weight is never silently left float.
    class Rhs(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x @ jnp.asarray(self.param("w", nn.initializers.ones, (2, 2)))

    variables = Rhs().init(jax.random.key(0), jnp.ones((2, 2)))
    with pytest.raises(ValueError, match="quantize_params"):
        qwix.quantize_model(Rhs(), qwix.PtqProvider(RULES)).apply(variables, jnp.ones((2, 2)))
