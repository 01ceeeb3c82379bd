"""LoRA as the reference's public API behaves: rules by keyword, sharding names on the adapters,
flax's nnx.LoRAParam, dropout bounds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import qmill.engine as qe

X = jnp.linspace(-1.0, 1.0, 5 * 16).reshape(5, 16)


def _rule(**kw) -> qe.LoraRule:
    return qe.LoraRule(rank=3, alpha=6.0, lora_b_initializer=nn.initializers.ones, **kw)


def test_rules_by_keyword_and_refusing_both_forms() -> None:
    provider = qe.LoraProvider(rules=[_rule()])
    model = qe.apply_lora_to_model(nnx.Linear(16, 8, rngs=nnx.Rngs(0)), provider, X)
    assert model.kernel_lora_a.shape == (16, 3) and model.kernel_lora_b.shape == (3, 8)
    with pytest.raises(ValueError, match="either rules or LoraRule fields"):
        qe.LoraProvider(rules=[_rule()], rank=3, alpha=1.0)


def test_nnx_adapters_are_flax_lora_params() -> None:
    linear = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
    model = qe.apply_lora_to_model(linear, qe.LoraProvider(rules=[_rule()]), X)
    found = nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))
    assert set(found) == {"kernel_lora_a", "kernel_lora_b"}
    assert isinstance(model.kernel_lora_a, nnx.LoRAParam)
    a, b = model.kernel_lora_a[...], model.kernel_lora_b[...]
    base = X @ model.kernel[...] + model.bias[...]
    # Same f32 products in a different association: a few ulps.
    np.testing.assert_allclose(model(X), base + (X @ a @ b) * 6.0 / 3, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight_qtype", [None, "int8"])
def test_linen_adapters_inherit_partitioning(weight_qtype) -> None:
    dense = nn.Dense(32, kernel_init=nn.with_partitioning(nn.zeros_init(), ("a", "b")))
    provider = qe.LoraProvider(module_path=".*", rank=3, alpha=6.0, weight_qtype=weight_qtype)
    variables = qe.apply_lora_to_model(dense, provider).init(jax.random.key(0), X)
    lora_a = variables["params"]["kernel_lora_a"]
    lora_b = variables["params"]["kernel_lora_b"]
    assert isinstance(lora_a, nn.Partitioned) and lora_a.names == ("a", None)
    assert lora_a.unbox().shape == (16, 3)
    assert isinstance(lora_b, nn.Partitioned) and lora_b.names == (None, "b")
    assert lora_b.unbox().shape == (3, 32)


def test_linen_conv_adapters_inherit_partitioning() -> None:
    conv = nn.Conv(
        8, (3, 3), kernel_init=nn.with_partitioning(nn.zeros_init(), (None, None, "in", "out"))
    )
    model = qe.apply_lora_to_model(conv, qe.LoraProvider(rank=3, alpha=1.0))
    params = model.init(jax.random.key(0), jnp.ones((1, 6, 6, 4)))["params"]
    assert params["kernel_lora_a"].names == (None, None, "in", None)
    assert params["kernel_lora_a"].unbox().shape == (3, 3, 4, 3)
    assert params["kernel_lora_b"].names == (None, "out")


def test_nnx_adapters_inherit_sharding_annotation() -> None:
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("a", "b"), eager_sharding=False)
    linear = nnx.Linear(16, 8, kernel_init=init, rngs=nnx.Rngs(0))
    model = qe.apply_lora_to_model(linear, qe.LoraProvider(rules=[_rule()]), X)
    assert model.kernel_lora_a.get_metadata()["out_sharding"] == ("a", None)
    assert model.kernel_lora_b.get_metadata()["out_sharding"] == (None, "b")


def test_dropout_one_drops_the_adapter() -> None:
    rules = [_rule(dropout=1.0)]
    linear = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
    model = qe.apply_lora_to_model(linear, qe.LoraProvider(rules=rules), X, rngs=nnx.Rngs(1))
    base = X @ model.kernel[...] + model.bias[...]
    np.testing.assert_array_equal(model(X), base)  # adapter input all zeros: delta exactly 0

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(x)

    linen = qe.apply_lora_to_model(M(), qe.LoraProvider(rules=rules))
    params = linen.init(jax.random.key(0), X)["params"]
    out = linen.apply({"params": params}, X, rngs={"dropout": jax.random.key(2)})
    np.testing.assert_array_equal(
        out,
        M().apply(
            {
                "params": {
                    "Dense_0": {
                        "kernel": params["Dense_0"]["kernel"],
                        "bias": params["Dense_0"]["bias"],
                    }
                }
            },
            X,
        ),
    )


@pytest.mark.parametrize("dropout", [-0.1, 1.5])
def test_dropout_outside_unit_interval_is_refused(dropout) -> None:
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\]"):
        _rule(dropout=dropout)


@pytest.mark.parametrize("dropout", [0.0, 1.0])
def test_nnx_training_with_rngs_set_after_the_fact(dropout) -> None:
    """The reference's NNX flow: apply without rngs, then model.set_attributes(qwix_rngs=...)."""
    linear = nnx.Linear(12, 10, rngs=nnx.Rngs(0))
    rules = [
        qe.LoraRule(
            module_path=".*",
            rank=3,
            alpha=0.5,
            dropout=dropout,
            lora_b_initializer=nnx.initializers.ones,
        )
    ]
    x = jnp.ones((10, 12))
    model = qe.apply_lora_to_model(linear, qe.LoraProvider(rules), x)
    model.set_attributes(qwix_rngs=nnx.Rngs(dropout=0))

    @nnx.jit
    def grads(m, x):
        return nnx.grad(lambda m, x: jnp.sum(jnp.abs(m(x))))(m, x)

    grads(model, x)
    found = nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))
    assert set(found) == {"kernel_lora_a", "kernel_lora_b"}
    expected = linear(x)
    if dropout == 0.0:
        a, b = found["kernel_lora_a"], found["kernel_lora_b"]
        expected = expected + x @ a @ b * 0.5 / 3
    np.testing.assert_allclose(model(x), expected, rtol=1e-5, atol=1e-5)


def test_nnx_dropout_draws_from_qwix_rngs() -> None:
    linear = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
    rules = [_rule(dropout=0.5)]
    model = qe.apply_lora_to_model(linear, qe.LoraProvider(rules=rules), X)
    base = X @ model.kernel[...] + model.bias[...]
    np.testing.assert_array_equal(model(X), model(X))  # no rngs anywhere: deterministic
    model.set_attributes(qwix_rngs=nnx.Rngs(dropout=1))
    first, second = model(X), model(X)
    assert not np.array_equal(first, second)  # a fresh mask per call
    assert not np.array_equal(first, base)
