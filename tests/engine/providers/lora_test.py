"""LoRA / QLoRA: adapters train, the frozen base stays bit-identical."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import qmill.engine as qe


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(16, 64, rngs=rngs)
        self.l2 = nnx.Einsum("bi,io->bo", (64, 4), rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


@pytest.mark.parametrize("qtype", ["nf4", "int4"])
def test_qlora_nnx_lowers_loss_and_keeps_base(qtype):
    x = jax.random.normal(jax.random.key(0), (32, 16))
    y = jax.random.normal(jax.random.key(1), (32, 4))
    rules = [qe.LoraRule(rank=4, alpha=4.0, weight_qtype=qtype, tile_size=16)]
    model = qe.apply_lora_to_model(Net(nnx.Rngs(0)), qe.LoraProvider(rules), x, rngs=nnx.Rngs(1))
    assert model.l1.kernel_lora_a.shape == (16, 4) and model.l1.kernel_lora_b.shape == (4, 64)
    assert model.l2.kernel_lora_b.shape == (4, 4)
    base_before = nnx.to_pure_dict(nnx.state(model, nnx.Not(qe.LoRAParam)))
    graphdef, lora, rest = nnx.split(model, qe.LoRAParam, ...)

    def loss_fn(lora):
        m = nnx.merge(graphdef, lora, rest)
        return jnp.mean((m(x) - y) ** 2)

    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    first, _ = grad_fn(lora)
    for _ in range(60):
        loss, g = grad_fn(lora)
        lora = jax.tree.map(lambda p, d: p - 0.05 * d, lora, g)
    assert float(loss) < 0.8 * float(first)
    after = nnx.to_pure_dict(nnx.state(nnx.merge(graphdef, lora, rest), nnx.Not(qe.LoRAParam)))
    jax.tree.map(np.testing.assert_array_equal, after, base_before)
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
