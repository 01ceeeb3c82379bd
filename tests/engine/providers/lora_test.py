"""LoRA / QLoRA: adapters train, the frozen base stays bit-identical."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import qmill.engine as qe
from tests import random_inputs


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(16, 64, rngs=rngs)
        self.l2 = nnx.Einsum("bi,io->bo", (64, 4), rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def _train_adapters(model, x, y, steps: int, lr: float):
    """Gradient descent on the mean squared error, LoRA params only: (first loss, last loss,
    trained model, its base params), the base params checked bit-identical to the model's."""
    base_before = nnx.to_pure_dict(nnx.state(model, nnx.Not(qe.LoRAParam)))
    graphdef, lora, rest = nnx.split(model, qe.LoRAParam, ...)

    def loss_fn(lora):
        return jnp.mean((nnx.merge(graphdef, lora, rest)(x) - y) ** 2)

    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    first, _ = grad_fn(lora)
    for _ in range(steps):
        loss, g = grad_fn(lora)
        lora = jax.tree.map(lambda p, d: p - lr * d, lora, g)
    trained = nnx.merge(graphdef, lora, rest)
    after = nnx.to_pure_dict(nnx.state(trained, nnx.Not(qe.LoRAParam)))
    jax.tree.map(np.testing.assert_array_equal, after, base_before)
    return first, loss, trained, after


@pytest.mark.parametrize("qtype", ["nf4", "int4"])
def test_qlora_nnx_lowers_loss_and_keeps_base(qtype):
    x = random_inputs.normal(jax.random.key(0), (32, 16))
    y = random_inputs.normal(jax.random.key(1), (32, 4))
    rules = [qe.LoraRule(rank=4, alpha=4.0, weight_qtype=qtype, tile_size=16)]
    model = qe.apply_lora_to_model(Net(nnx.Rngs(0)), qe.LoraProvider(rules), x, rngs=nnx.Rngs(1))
    assert model.l1.kernel_lora_a.shape == (16, 4) and model.l1.kernel_lora_b.shape == (4, 64)
    assert model.l2.kernel_lora_b.shape == (4, 4)
    first, loss, _, after = _train_adapters(model, x, y, steps=60, lr=0.05)
    assert float(loss) < 0.8 * float(first)
    assert after["l1"]["kernel"]["array"]["qvalue"].dtype != jnp.float32


def test_lora_linen_layout_and_starts_as_base():
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, use_bias=False)(x)

    x = jnp.ones((2, 16))
    lora_model = qe.quantize_model(M(), qe.LoraProvider(rank=2, alpha=2.0))
    variables = lora_model.init(jax.random.key(0), x)
    params = variables["params"]["Dense_0"]
    assert params["kernel_lora_a"].shape == (16, 2) and params["kernel_lora_b"].shape == (2, 4)
    # lora_b starts at zero: the adapted model is the base model.
    base = M().apply({"params": {"Dense_0": {"kernel": params["kernel"]}}}, x)
    np.testing.assert_allclose(lora_model.apply(variables, x), base, rtol=1e-6)


class LinenConv(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Conv(4, (3, 3), use_bias=False)(x)


def _conv_lora_delta(x, a, b, scale):
    t = jax.lax.conv_general_dilated(
        x, a, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    return scale * (t @ b)


def test_lora_conv_linen_changes_output_only_through_the_adapter_and_trains():
    x = random_inputs.normal(jax.random.key(0), (4, 6, 6, 3))
    y = random_inputs.normal(jax.random.key(1), (4, 6, 6, 4))
    model = qe.quantize_model(LinenConv(), qe.LoraProvider(rank=2, alpha=4.0))
    params = model.init(jax.random.key(2), x)["params"]
    p = params["Conv_0"]
    assert p["kernel_lora_a"].shape == (3, 3, 3, 2) and p["kernel_lora_b"].shape == (2, 4)
    base = LinenConv().apply({"params": {"Conv_0": {"kernel": p["kernel"]}}}, x)
    np.testing.assert_allclose(model.apply({"params": params}, x), base, rtol=1e-6)
    # A non-zero lora_b: output = base conv + (alpha / rank) * conv(x, A) · B.
    b = random_inputs.normal(jax.random.key(3), (2, 4))
    params = {"Conv_0": {**p, "kernel_lora_b": b}}
    expected = base + _conv_lora_delta(x, p["kernel_lora_a"], b, 2.0)
    np.testing.assert_allclose(model.apply({"params": params}, x), expected, atol=1e-4)

    def loss(params):
        return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

    grad_fn = jax.jit(jax.value_and_grad(loss))
    first, g = grad_fn(params)
    # The base kernel gets no gradient at all: only the adapter trains.
    np.testing.assert_array_equal(g["Conv_0"]["kernel"], 0)
    assert float(jnp.abs(g["Conv_0"]["kernel_lora_a"]).max()) > 0
    for _ in range(30):
        value, g = grad_fn(params)
        params = jax.tree.map(lambda q, d: q - 0.02 * d, params, g)
    assert float(value) < 0.9 * float(first)
    np.testing.assert_array_equal(params["Conv_0"]["kernel"], p["kernel"])


class NnxConvNet(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 4, (3, 3), use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.conv(x)


def test_qlora_conv_nnx_keeps_base_and_lowers_loss():
    x = random_inputs.normal(jax.random.key(0), (4, 6, 6, 3))
    rules = [qe.LoraRule(rank=2, alpha=2.0, weight_qtype="int4")]
    model = qe.apply_lora_to_model(NnxConvNet(nnx.Rngs(0)), qe.LoraProvider(rules), x)
    # A target the adapter can reach: the base plus some other rank-2 conv adapter.
    a_true = 0.3 * random_inputs.normal(jax.random.key(1), (3, 3, 3, 2))
    y = model(x) + _conv_lora_delta(x, a_true, random_inputs.normal(jax.random.key(2), (2, 4)), 1.0)
    assert model.conv.kernel_lora_a.shape == (3, 3, 3, 2)
    assert isinstance(model.conv.kernel_lora_b, qe.LoRAParam)
    kernel = model.conv.kernel[...]
    assert kernel.array.qvalue.dtype == jnp.int4
    first, value, trained, _ = _train_adapters(model, x, y, steps=100, lr=0.1)
    assert float(value) < 0.5 * float(first)
    # The trained output is the int4 base conv plus the adapter's, exactly as specified.
    base = jax.lax.conv_general_dilated(
        x, qe.dequantize(kernel.array), (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    la = trained.conv.kernel_lora_a[...]
    expected = base + _conv_lora_delta(x, la, trained.conv.kernel_lora_b[...], 1.0)
    np.testing.assert_allclose(trained(x), expected, atol=1e-4)


def test_lora_dropout_nnx_trains_stochastically_and_evaluates_deterministically():
    x = random_inputs.normal(jax.random.key(0), (8, 16))
    rules = [qe.LoraRule(rank=4, alpha=4.0, dropout=0.5)]

    def make(rngs):
        return qe.apply_lora_to_model(Net(nnx.Rngs(0)), qe.LoraProvider(rules), x, rngs=rngs)

    model = make(nnx.Rngs(1))
    # lora_b starts at zero: dropout on the adapter's input can't change the output yet.
    np.testing.assert_allclose(model(x), model(x), rtol=0)
    model.l1.kernel_lora_b[...] = jnp.ones((4, 64))
    a, b = model(x), model(x)
    assert not np.allclose(a, b)  # a fresh mask per call
    jitted = nnx.jit(lambda m, x: m(x))
    assert not np.allclose(jitted(model, x), jitted(model, x))  # rng state advances under jit
    model.eval()
    np.testing.assert_array_equal(model(x), model(x))
    # Eval output = no dropout; a model built without rngs has no dropout at all.
    plain = make(None)
    assert not hasattr(plain.l1, "kernel_lora_dropout")
    plain.l1.kernel_lora_a[...] = model.l1.kernel_lora_a[...]
    plain.l1.kernel_lora_b[...] = jnp.ones((4, 64))
    np.testing.assert_allclose(model(x), plain(x), rtol=1e-6)
    np.testing.assert_array_equal(plain(x), plain(x))


def test_lora_dropout_linen_needs_a_dropout_rng():
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, use_bias=False)(x)

    x = random_inputs.normal(jax.random.key(0), (8, 16))
    model = qe.quantize_model(M(), qe.LoraProvider(rank=2, alpha=2.0, dropout=0.5))
    params = model.init(jax.random.key(1), x)["params"]
    params["Dense_0"]["kernel_lora_b"] = jnp.ones((2, 8))
    eval_out = model.apply({"params": params}, x)
    np.testing.assert_array_equal(eval_out, model.apply({"params": params}, x))
    r1 = model.apply({"params": params}, x, rngs={"dropout": jax.random.key(2)})
    r2 = model.apply({"params": params}, x, rngs={"dropout": jax.random.key(3)})
    assert not np.allclose(r1, eval_out) and not np.allclose(r1, r2)
