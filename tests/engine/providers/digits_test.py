"""End to end on real data: a small CNN on scikit-learn's bundled digits (no downloads)."""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import qmill.engine as qe
from tests import digits_data


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        x = x.reshape(x.shape[0], -1)  # 8 * 8 * 32 = 2048 features
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(10)(x)


@pytest.fixture(scope="module")
def data():
    return digits_data.split()


def _train(model, variables, x, y, *, epochs, lr, mutable=()):
    """Plain Adam over the params; other collections (quant_stats) are updated by the model."""
    params = variables["params"]
    others = {k: v for k, v in variables.items() if k != "params"}
    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)

    @jax.jit
    def step(params, others, m, v, t, xb, yb):
        def loss_fn(p):
            out = model.apply({"params": p, **others}, xb, mutable=list(mutable) or False)
            logits, upd = out if mutable else (out, {})
            loss = -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(yb)), yb])
            return loss, upd

        (loss, upd), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
        m = jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, m, g)
        v = jax.tree.map(lambda a, b: 0.999 * a + 0.001 * b * b, v, g)
        corr = jnp.sqrt(1 - 0.999**t) / (1 - 0.9**t)
        params = jax.tree.map(
            lambda p, a, b: p - lr * corr * a / (jnp.sqrt(b) + 1e-8), params, m, v
        )
        return params, {**others, **upd}, m, v, loss

    t = 0
    for epoch in range(epochs):
        order = np.random.default_rng(epoch).permutation(len(x))
        for i in range(0, len(x) - 63, 64):
            t += 1
            idx = order[i : i + 64]
            params, others, m, v, _ = step(params, others, m, v, t, x[idx], y[idx])
    return {"params": params, **others}


def _accuracy(apply, variables, x, y) -> float:
    logits = jax.jit(apply)(variables, x)
    return float(np.mean(np.argmax(logits, -1) == y)) * 100


@pytest.fixture(scope="module")
def float_model(data):
    (x, y), _ = data
    model = CNN()
    variables = model.init(jax.random.key(0), x[:1])
    return model, _train(model, variables, x, y, epochs=8, lr=3e-3)


def _ptq(rules, params, quant_stats, x):
    ptq_model = qe.quantize_model(CNN(), qe.PtqProvider(rules))
    abstract = jax.eval_shape(ptq_model.init, jax.random.key(0), x[:1])
    return ptq_model, qe.quantize_params(params, abstract["params"], quant_stats)


@pytest.mark.slow
def test_qt_w8a8_static_then_ptq_keeps_accuracy(data, float_model):
    (x, y), (xt, yt) = data
    model, variables = float_model
    float_acc = _accuracy(model.apply, variables, xt, yt)
    assert float_acc > 90
    rules = [qe.QtRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]
    qt_model = qe.quantize_model(CNN(), qe.QtProvider(rules))
    qt_vars = qt_model.init(jax.random.key(0), x[:1])
    qt_vars = _train(
        qt_model,
        {**qt_vars, "params": variables["params"]},
        x,
        y,
        epochs=2,
        lr=5e-4,
        mutable=("quant_stats",),
    )
    stats = qt_vars["quant_stats"]["Conv_1"]["conv_general_dilated0_lhs"]
    assert int(stats["count"]) == 2 * (1400 // 64)
    ptq_model, ptq_params = _ptq(rules, qt_vars["params"], qt_vars["quant_stats"], x)
    ptq_acc = _accuracy(ptq_model.apply, {"params": ptq_params}, xt, yt)
    print(f"float {float_acc:.2f}  qt->ptq w8a8 static {ptq_acc:.2f}")
    assert ptq_acc >= float_acc - 0.5


@pytest.mark.slow
def test_weight_only_int4_tiled_ptq_keeps_accuracy(data, float_model):
    (x, _), (xt, yt) = data
    model, variables = float_model
    float_acc = _accuracy(model.apply, variables, xt, yt)
    rules = [qe.QuantizationRule(weight_qtype="int4", tile_size=32)]
    ptq_model, ptq_params = _ptq(rules, variables["params"], {}, x)
    assert ptq_params["Dense_0"]["kernel"].array.scale.shape == (2048 // 32, 64)
    ptq_acc = _accuracy(ptq_model.apply, {"params": ptq_params}, xt, yt)
    print(f"float {float_acc:.2f}  ptq int4 tile 32 {ptq_acc:.2f}")
    assert ptq_acc >= float_acc - 2.0


def _loss(logits, y):
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(y)), y])


def _split_lora(params):
    flat = flax.traverse_util.flatten_dict(params)
    lora = {k: v for k, v in flat.items() if "_lora_" in k[-1]}
    frozen = {k: v for k, v in flat.items() if k not in lora}
    return lora, frozen


@pytest.mark.slow
def test_qlora_fine_tune_lowers_loss_and_keeps_the_base(data, float_model):
    (x, y), (xt, yt) = data
    model, variables = float_model
    rules = [qe.LoraRule(rank=4, alpha=4.0, weight_qtype="nf4", tile_size=32)]
    lora_model = qe.quantize_model(CNN(), qe.LoraProvider(rules))
    abstract = jax.eval_shape(lora_model.init, jax.random.key(0), x[:1])["params"]
    base = qe.quantize_params(variables["params"], abstract)
    fresh = lora_model.init(jax.random.key(1), x[:1])["params"]
    lora, _ = _split_lora(fresh)
    _, frozen = _split_lora(base)
    assert ("Conv_1", "kernel_lora_a") in lora and ("Dense_0", "kernel_lora_b") in lora
    assert frozen[("Conv_0", "kernel")].array.qtype == "nf4"

    def apply(lora, xb):
        params = flax.traverse_util.unflatten_dict({**frozen, **lora})
        return lora_model.apply({"params": params}, xb)

    @jax.jit
    def step(lora, m, v, t, xb, yb):
        loss, g = jax.value_and_grad(lambda p: _loss(apply(p, xb), yb))(lora)
        m = jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, m, g)
        v = jax.tree.map(lambda a, b: 0.999 * a + 0.001 * b * b, v, g)
        corr = jnp.sqrt(1 - 0.999**t) / (1 - 0.9**t)
        lora = jax.tree.map(lambda p, a, b: p - 1e-3 * corr * a / (jnp.sqrt(b) + 1e-8), lora, m, v)
        return lora, m, v, loss

    eval_loss = jax.jit(lambda lora: _loss(apply(lora, x), y))
    frozen_before = jax.tree.map(np.asarray, frozen)
    loss_before = float(eval_loss(lora))
    acc_before = float(np.mean(np.argmax(jax.jit(apply)(lora, xt), -1) == yt)) * 100
    m = jax.tree.map(jnp.zeros_like, lora)
    v = jax.tree.map(jnp.zeros_like, lora)
    order = np.random.default_rng(0).permutation(len(x))
    for t, i in enumerate(range(0, len(x) - 63, 64), start=1):
        idx = order[i : i + 64]
        lora, m, v, _ = step(lora, m, v, t, x[idx], y[idx])
    loss_after = float(eval_loss(lora))
    acc_after = float(np.mean(np.argmax(jax.jit(apply)(lora, xt), -1) == yt)) * 100
    float_acc = _accuracy(model.apply, variables, xt, yt)
    print(
        f"float {float_acc:.2f}  qlora nf4: train loss {loss_before:.4f} -> {loss_after:.4f}, "
        f"test acc {acc_before:.2f} -> {acc_after:.2f}"
    )
    assert loss_after < loss_before
    assert acc_after >= float_acc - 2.0
    jax.tree.map(np.testing.assert_array_equal, frozen, frozen_before)
