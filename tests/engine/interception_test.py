import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import qmill.engine as qe
from qmill.engine import interception
from tests import random_inputs

RULES = [qe.QuantizationRule(weight_qtype="int8", act_qtype="int8")]


def test_handlers_route_only_this_thread_and_are_removed():
    seen = []
    other_thread = []

    def handler(*args, **kwargs):
        seen.append(1)
        return jax.lax.dot_general(*args, **kwargs)  # suspended: reaches the original

    def other():
        other_thread.append(jnp.ones((2, 2)) @ jnp.ones((2, 2)))

    with interception.intercepted({"jax.lax.dot_general": handler}):
        assert interception.is_patched("jax.lax.dot_general")
        jax.lax.dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)), (((1,), (0,)), ((), ())))
        t = threading.Thread(
            target=lambda: jax.lax.dot_general(
                jnp.ones((2, 2)), jnp.ones((2, 2)), (((1,), (0,)), ((), ()))
            )
        )
        t.start()
        t.join()
    assert seen == [1]
    assert not interception.is_patched("jax.lax.dot_general")
    assert not hasattr(jax.lax.dot_general, "__qmill_original__")


def test_nothing_stays_patched_when_the_model_raises():
    class Boom(nn.Module):
        @nn.compact
        def __call__(self, x):
            nn.Dense(2)(x)
            raise RuntimeError("boom")

    model = qe.quantize_model(Boom(), qe.PtqProvider(RULES))
    with pytest.raises(RuntimeError, match="boom"):
        model.init(jax.random.key(0), jnp.ones((1, 3)))
    for target in qe.PtqProvider(RULES).get_intercept_map():
        assert not interception.is_patched(target), target
    assert "__qmill_original__" not in vars(nn.Module)["param"].__dict__


def test_concurrent_models_in_threads():
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(x)

    x = random_inputs.normal(jax.random.key(0), (4, 8))
    variables = M().init(jax.random.key(1), x)
    expected = M().apply(variables, x)
    qmodel = qe.quantize_model(M(), qe.PtqProvider(RULES))
    results, errors = [], []

    def run(quantized):
        try:
            for _ in range(5):
                if quantized:
                    results.append(qmodel.apply(variables, x, mutable=True)[0])
                else:
                    np.testing.assert_array_equal(M().apply(variables, x), expected)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i % 2 == 0,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert results and not np.array_equal(results[0], expected)


class Reshaping(nnx.Module):
    """Uses its weight through a reshape and a transpose before the op."""

    def __init__(self, rngs):
        self.w = nnx.Param(random_inputs.normal(rngs.params(), (2, 4, 8)))

    def __call__(self, x):
        return x @ self.w[...].reshape(8, 8).T


def test_weight_found_through_reshape_and_transpose_in_qt():
    x = random_inputs.normal(jax.random.key(0), (4, 8))
    rules = [qe.QuantizationRule(weight_qtype="int4")]  # weight-only: an activation stays exact
    model = qe.quantize_model(Reshaping(nnx.Rngs(0)), qe.QtProvider(rules), x)
    w = model.w[...].reshape(8, 8).T
    how = qe.HowToQuantize(qtype="int4", channelwise_axes=(1,))
    fq = qe.dequantize(qe.qarray.quantize(w, how))
    np.testing.assert_allclose(model(x), x @ fq, rtol=1e-5, atol=1e-5)
    assert not np.allclose(model(x), x @ w, atol=1e-3)


def test_ptq_refuses_transposed_weight():
    x = random_inputs.normal(jax.random.key(0), (4, 8))
    with pytest.raises(ValueError, match="transpose"):
        qe.quantize_model(Reshaping(nnx.Rngs(0)), qe.PtqProvider(RULES), x)
