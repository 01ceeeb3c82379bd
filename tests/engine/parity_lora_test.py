"""Reference behaviours of LoRA (issue 30): adapters on batched dot_generals, the adapters'
einsum kept on NNX modules, and adapters placed like a mesh-placed base weight."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

import qmill.engine as qwix
from tests import random_inputs

ONES = [qwix.LoraRule(rank=2, alpha=2.0, lora_b_initializer=jax.nn.initializers.ones)]
DN = (((2,), (1,)), ((0,), (0,)))  # one (4, 6) matrix per head: batch axis 0


class LinenBatched(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (5, 4, 6))
        return jax.lax.dot_general(x, w, DN)


class NnxBatched(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(random_inputs.normal(jax.random.key(0), (5, 4, 6)))

    def __call__(self, x):
        return jax.lax.dot_general(x, self.w[...], DN)


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_batched_dot_general_gets_adapters(framework):
    x = random_inputs.normal(jax.random.key(1), (5, 3, 4))
    if framework == "linen":
        model = qwix.apply_lora_to_model(LinenBatched(), qwix.LoraProvider(ONES))
        params = model.init(jax.random.key(0), x)["params"]
        w, a, b = params["w"], params["w_lora_a"], params["w_lora_b"]
        out = model.apply({"params": params}, x)
    else:
        model = qwix.apply_lora_to_model(NnxBatched(), qwix.LoraProvider(ONES), x, rngs=nnx.Rngs(1))
        w, a, b = model.w[...], model.w_lora_a[...], model.w_lora_b[...]
        out = model(x)
    # One adapter pair per batch index: lora_a (5, 4, rank), lora_b (5, rank, 6).
    assert a.shape == (5, 4, 2) and b.shape == (5, 2, 6)
    expected = jnp.einsum("hbi,hij->hbj", x, w) + jnp.einsum("hbi,hir,hrj->hbj", x, a, b)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_nnx_einsum_keeps_the_adapters_einsum():
    x = jnp.ones((3, 4))
    model = qwix.apply_lora_to_model(
        nnx.Einsum("bi,ij->bj", (4, 5), rngs=nnx.Rngs(0)),
        qwix.LoraProvider(ONES),
        x,
        rngs=nnx.Rngs(1),
    )
    # As the reference: lhs, lora_a, lora_b, with the rank as "r".
    assert model.kernel_lora_einsum_str == "bi,ir,rj->bj"
    a, b = model.kernel_lora_a[...], model.kernel_lora_b[...]
    expected = x @ model.kernel[...] + jnp.einsum(model.kernel_lora_einsum_str, x, a, b)
    np.testing.assert_allclose(model(x), expected, rtol=1e-5, atol=1e-5)


def test_conv_adapter_is_placed_like_a_mesh_placed_kernel():
    mesh = jax.make_mesh((1, 1), ("in", "out"))
    x = jnp.ones((1, 8, 8, 4))
    with jax.set_mesh(mesh):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, None, "in", "out"))
        conv = nnx.Conv(4, 6, (3, 3), kernel_init=init, rngs=nnx.Rngs(0))
        model = qwix.apply_lora_to_model(conv, qwix.LoraProvider(ONES), x, rngs=nnx.Rngs(1))
    assert model.kernel_lora_a[...].sharding.spec == P(None, None, "in", None)
    assert model.kernel_lora_b[...].sharding.spec == P(None, "out")


def test_batched_einsum_gets_adapters_as_the_reference():
    class Batched(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(random_inputs.normal(jax.random.key(0), (16, 10, 8, 4, 5)))

        def __call__(self, x):
            return jnp.einsum("bjir,bnmjr->bimn", x, self.w[...])

    x = random_inputs.normal(jax.random.key(1), (16, 4, 12, 5))
    model = qwix.apply_lora_to_model(Batched(), qwix.LoraProvider(ONES), x, rngs=nnx.Rngs(1))
    assert model.w_lora_einsum_str == "bjir,bjrA,Anm->bimn"
    a, b = model.w_lora_a[...], model.w_lora_b[...]
    assert a.shape == (16, 4, 5, 2) and b.shape == (2, 10, 8)
    expected = jnp.einsum("bjir,bnmjr->bimn", x, model.w[...]) + jnp.einsum(
        model.w_lora_einsum_str, x, a, b
    )
    np.testing.assert_allclose(model(x), expected, rtol=1e-4, atol=1e-4)


MULTI = (((1,), (0,)), ((), ()))  # x (3, 4) · w (4, 5, 6): two output axes


class LinenMultiOutput(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.lecun_normal(), (4, 5, 6))
        return jax.lax.dot_general(x, w, MULTI)


class NnxMultiOutput(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(random_inputs.normal(jax.random.key(0), (4, 5, 6)))

    def __call__(self, x):
        return jax.lax.dot_general(x, self.w[...], MULTI)


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_multi_output_dot_general_gets_adapters(framework):
    x = random_inputs.normal(jax.random.key(1), (3, 4))
    if framework == "linen":
        model = qwix.apply_lora_to_model(LinenMultiOutput(), qwix.LoraProvider(ONES))
        params = model.init(jax.random.key(0), x)["params"]
        w, a, b = params["w"], params["w_lora_a"], params["w_lora_b"]
        out = model.apply({"params": params}, x)
    else:
        model = qwix.apply_lora_to_model(
            NnxMultiOutput(), qwix.LoraProvider(ONES), x, rngs=nnx.Rngs(1)
        )
        w, a, b = model.w[...], model.w_lora_a[...], model.w_lora_b[...]
        out = model(x)
    # As the reference: the output axes flattened in lora_b, (rank, 5 * 6).
    assert a.shape == (4, 2) and b.shape == (2, 30)
    b = b.reshape(2, 5, 6)
    expected = jnp.einsum("bi,ijk->bjk", x, w) + jnp.einsum("bi,ir,rjk->bjk", x, a, b)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_dot_general_adapters_flattened_as_the_reference():
    """A batched weight with two output axes: the adapters' shapes the reference gives (checked
    against qwix 0.1.8, with the same values from the same key; also (12, 3) / (3, 6) for two
    contracting axes), lora_a (*batch, prod(contracting), rank), lora_b (*batch, rank,
    prod(free))."""

    class Batched(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.lecun_normal(), (2, 4, 4, 4))
            return jax.lax.dot_general(x, w, (((2,), (1,)), ((0,), (0,))))

    rule = qwix.LoraRule(rank=3, alpha=3.0, lora_b_initializer=jax.nn.initializers.ones)
    x = random_inputs.normal(jax.random.key(1), (2, 5, 4))
    model = qwix.apply_lora_to_model(Batched(), qwix.LoraProvider([rule]))
    params = nn.unbox(model.init(jax.random.key(0), x)["params"])
    w, a, b = params["w"], params["w_lora_a"], params["w_lora_b"]
    assert a.shape == (2, 4, 3) and b.shape == (2, 3, 16)
    delta = jnp.einsum("hbi,hir,hrjk->hbjk", x, a, b.reshape(2, 3, 4, 4))
    expected = jnp.einsum("hbi,hijk->hbjk", x, w) + delta
    np.testing.assert_allclose(model.apply({"params": params}, x), expected, rtol=1e-5, atol=1e-5)


def test_nnx_einsum_with_two_output_axes_as_the_reference():
    # The reference's case: "btd,dnh->btnh" adapts as "btd,dr,rnh->btnh".
    base = nnx.Einsum("btd,dnh->btnh", (12, 8, 10), (8, 10), rngs=nnx.Rngs(0))
    x = random_inputs.normal(jax.random.key(2), (16, 4, 12))
    expected_base = base(x)
    rule = qwix.LoraRule(rank=3, alpha=1.0, lora_b_initializer=nnx.initializers.ones)
    model = qwix.apply_lora_to_model(base, qwix.LoraProvider([rule]), x, rngs=nnx.Rngs(1))
    assert model.kernel_lora_einsum_str == "btd,dr,rnh->btnh"
    a, b = model.kernel_lora_a[...], model.kernel_lora_b[...]
    assert a.shape == (12, 3) and b.shape == (3, 8, 10)
    expected = expected_base + jnp.einsum("btd,dr,rnh->btnh", x, a, b) / 3  # alpha / rank
    np.testing.assert_allclose(model(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", [None, "int8"])
def test_conv_adapter_sharding_metadata_as_the_reference(qtype):
    mesh = jax.make_mesh((1, 1), ("in", "out"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jnp.ones((1, 8, 8, 16))
    init = nnx.with_partitioning(nnx.initializers.zeros, (None, None, "in", "out"))
    provider = qwix.LoraProvider(weight_qtype=qtype, act_qtype=qtype, rank=3, alpha=1.0)
    with jax.set_mesh(mesh):
        conv = nnx.Conv(16, 32, (3, 3), kernel_init=init, rngs=nnx.Rngs(0))
        model = qwix.apply_lora_to_model(conv, provider, x)
    a, b = model.kernel_lora_a, model.kernel_lora_b
    assert isinstance(a, nnx.LoRAParam) and a.shape == (3, 3, 16, 3) and b.shape == (3, 32)
    assert a.get_metadata()["out_sharding"] == (None, None, "in", None)
    assert a[...].sharding.spec == P(None, None, "in", None)
    assert b.get_metadata()["out_sharding"] == (None, "out")
    assert b[...].sharding.spec == P(None, "out")
