"""Reference behaviours of interception and rules (issue 30): interceptors chain and apply once
per thread, interception is thread-local (guarded by timeouts: a failure must fail, never
hang), unused rules are asked for after quantize_model, and the invalid-rule message."""

import functools
import inspect
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import qmill.engine as qwix
from qmill.engine import interception
from tests import random_inputs

WAIT_S = 30  # every blocking wait below gives up after this: a broken run fails, never hangs


@pytest.mark.timeout(120)
def test_interception_is_thread_local_and_cannot_deadlock():
    started, release = threading.Event(), threading.Event()

    def func(x, in_thread2=False):
        if in_thread2:
            started.set()
            assert release.wait(WAIT_S), "the main thread never released the worker"
        return jnp.sin(x)

    func = interception.wrap_func_intercepted(
        func,
        lambda: interception.Interceptor(
            mapping={
                "jax.numpy.sin": lambda x: jax.lax.sin(x) + 42.0,
                "jax.lax.sin": lambda x: x / 0,  # outside every block: never called
            },
            id="thread-local",
        ),
        disable_jit=True,
    )
    results, errors = [], []

    def worker():
        try:
            results.append(func(0.0, in_thread2=True))
        except BaseException as e:  # reported by the main thread, not swallowed
            errors.append(e)
            started.set()

    th = threading.Thread(target=worker, daemon=True)
    th.start()
    try:
        assert started.wait(WAIT_S), "the worker never reached the intercepted function"
        assert not errors, errors
        # The worker is inside its intercepted call; this thread sees the originals...
        assert float(jnp.sin(0.0)) == 0.0 and float(jax.lax.sin(0.0)) == 0.0
        # ...and its own call of the same function is intercepted.
        assert float(func(0.0)) == 42.0
    finally:
        release.set()
        th.join(WAIT_S)
    assert not th.is_alive(), "the worker did not finish"
    assert not errors, errors
    assert [float(r) for r in results] == [42.0]


def test_interceptors_apply_once_and_chain():
    def func1(x):
        return jnp.sin(x)

    def func2(x):
        return func1(x) + 1

    one = lambda: interception.Interceptor({"jax.numpy.sin": lambda x: jnp.sin(x) + 10}, id=1)  # noqa: E731
    func1 = interception.wrap_func_intercepted(func1, one, output_transform=lambda x: x + 100)
    assert float(func1(0.0)) == 110.0 and float(func2(0.0)) == 111.0
    # The same interceptor around func2: func1's wrapping no longer applies (once per thread).
    func2 = interception.wrap_func_intercepted(func2, one, output_transform=lambda x: x + 1000)
    assert float(func2(0.0)) == 1011.0
    # Another interceptor outside: the inner handler's own sin reaches the outer one.
    two = lambda: interception.Interceptor({"jax.numpy.sin": lambda x: jnp.sin(x) * 2 + 0.1}, id=2)  # noqa: E731
    func2 = interception.wrap_func_intercepted(func2, two, output_transform=lambda x: x + 10000)
    assert float(func2(0.0)) == pytest.approx(11021.1)


class LinenTwo(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="lin1")(x) + nn.Dense(4, name="other")(x)


class NnxTwo(nnx.Module):
    def __init__(self, rngs):
        self.lin1 = nnx.Linear(4, 4, rngs=rngs)
        self.other = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.lin1(x) + self.other(x)


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_unused_rules_are_asked_for_after_quantize_model(framework):
    used = qwix.QuantizationRule(module_path="lin1", weight_qtype="int8")
    typo = qwix.QuantizationRule(module_path="LIN1", weight_qtype="int8")
    provider = qwix.PtqProvider([used, typo])
    with pytest.raises(
        ValueError,
        match=r"Quantization is not completed yet. Please call `quantize_model` before calling "
        r"`get_unused_rules`.",
    ):
        provider.get_unused_rules()
    x = jnp.ones((1, 4))
    if framework == "linen":
        qwix.quantize_model(LinenTwo(), provider).init(jax.random.key(0), x)
    else:
        qwix.quantize_model(NnxTwo(nnx.Rngs(0)), provider, x)
    assert provider.get_unused_rules() == [typo]


def test_invalid_rule_static_scale_without_act_qtype():
    with pytest.raises(ValueError, match="act_static_scale is set to True but act_qtype is None"):
        qwix.PtqProvider([qwix.QuantizationRule(weight_qtype="int8", act_static_scale=True)])


# ---- issue 40: aliases bound before the call are intercepted, as the reference --------------

ALIAS_DOT = jax.lax.dot_general  # bound at import, before any model ran
DN = (((1,), (0,)), ((), ()))


def test_alias_of_a_function_is_intercepted():
    # The reference's case: jax.lax.sin is a plain function, patched in its code.
    alias_sin = jax.lax.sin

    def func(x):
        return alias_sin(x)

    def replaced_sin(x):
        return jax.lax.sin(x) + n

    wrapped = interception.wrap_func_intercepted(
        func, lambda: interception.Interceptor({"jax.lax.sin": replaced_sin}, id="alias")
    )
    n = 42
    assert float(wrapped(0.0)) == 42.0
    assert float(alias_sin(0.0)) == 0.0 and "qmill" not in jax.lax.sin.__code__.co_filename


def test_only_calls_from_outside_jax_reach_the_handler():
    seen = []

    def handler(*args, **kwargs):
        seen.append(1)
        return jax.lax.dot_general(*args, **kwargs)

    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    signature = inspect.signature(jax.lax.dot_general)
    with interception.intercepted({"jax.lax.dot_general": handler}):
        assert inspect.signature(jax.lax.dot_general) == signature
        ALIAS_DOT(x, w, DN)
        functools.partial(ALIAS_DOT, dimension_numbers=DN)(x, w)
        assert len(seen) == 2
        # jnp.matmul lowers to lax.dot_general inside JAX: not a model's call, as before.
        with jax.disable_jit():
            jnp.matmul(x, w)
        assert len(seen) == 2
    ALIAS_DOT(x, w, DN)
    assert len(seen) == 2 and not interception.is_patched("jax.lax.dot_general")


class AliasDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (8, 4))
        return ALIAS_DOT(x, w, DN)


def test_a_model_calling_an_alias_is_quantized():
    x = random_inputs.normal(jax.random.key(0), (2, 8))
    ptq = qwix.quantize_model(
        AliasDense(), qwix.PtqProvider([qwix.QuantizationRule(weight_qtype="int8")])
    )
    variables = ptq.init(jax.random.key(1), x)
    w = variables["params"]["w"]
    assert isinstance(w, qwix.WithAux)
    expected = x @ qwix.dequantize(w.array)
    np.testing.assert_allclose(ptq.apply(variables, x), expected, rtol=1e-5, atol=1e-5)
