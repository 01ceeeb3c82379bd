"""Accuracy of the digits CNN quantized by RTN, GPTQ and AWQ, W4 and W3 (issue #25).

    python bench/calibrated_digits_bench.py [--seeds 3] [--bits 4,3] [--json PATH]

The CNN of tests/engine/providers/digits_test.py (Conv 16, Conv 32, Dense 2048→64, Dense 64→10)
trained the same way (a copy of that test's loop: Adam, 8 epochs) on scikit-learn's bundled 8x8
digits: 1,400 training images,
397 held out (the same split). Quantized: both Dense kernels, weights only; Dense_0 in groups
of 128 along its 2,048 input features, Dense_1 (64 inputs, fewer than a group) per output
channel, i.e. one group of 64 (GPTQ refuses a group size that does not divide the columns). The
convolutions stay float: GPTQ and AWQ collect statistics of dot_general / einsum inputs only.
Calibration: 512 training images, 8 batches of 64. Reported per training seed and as the mean:
held-out accuracy (%) and agreement with the float model's predictions (%).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

import qmill.engine as qe
from qmill.engine.contrib import awq, gptq

CALIB, BATCH = 512, 64


def CNN() -> nn.Module:
    """The digits CNN the library ships (zoo.Cnn's defaults: the same names and shapes as
    tests/engine/providers/digits_test.py's)."""
    return qe.zoo.Cnn(qe.zoo.CnnConfig())


def data():
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from tests import digits_data

    return digits_data.split()


def train(x, y, seed: int, epochs: int = 8, lr: float = 3e-3) -> dict:
    """Plain Adam, batches of 64 (digits_test.py's loop)."""
    model = CNN()
    params = model.init(jax.random.key(seed), x[:1])["params"]
    m = jax.tree.map(jnp.zeros_like, params)
    v = jax.tree.map(jnp.zeros_like, params)

    @jax.jit
    def step(params, m, v, t, xb, yb):
        def loss_fn(p):
            logits = model.apply({"params": p}, xb)
            return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(yb)), yb])

        g = jax.grad(loss_fn)(params)
        m = jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, m, g)
        v = jax.tree.map(lambda a, b: 0.999 * a + 0.001 * b * b, v, g)
        corr = jnp.sqrt(1 - 0.999**t) / (1 - 0.9**t)
        params = jax.tree.map(
            lambda p, a, b: p - lr * corr * a / (jnp.sqrt(b) + 1e-8), params, m, v
        )
        return params, m, v

    t = 0
    for epoch in range(epochs):
        order = np.random.default_rng(seed * 100 + epoch).permutation(len(x))
        for i in range(0, len(x) - BATCH + 1, BATCH):
            t += 1
            idx = order[i : i + BATCH]
            params, m, v = step(params, m, v, t, x[idx], y[idx])
    return params


def rules(cls, bits: int) -> list:
    qtype = f"int{bits}"
    return [
        cls(module_path="Dense_0", weight_qtype=qtype, tile_size=128),
        cls(module_path="Dense_1", weight_qtype=qtype),
    ]


def predict(model, params, x) -> np.ndarray:
    return np.asarray(jnp.argmax(jax.jit(model.apply)({"params": params}, x), -1))


def calibrate(provider, params, x) -> dict:
    calibrating = qe.quantize_model(CNN(), provider)
    step = jax.jit(lambda v, xb: calibrating.apply(v, xb, mutable="quant_stats")[1])
    variables = {"params": params}
    for i in range(0, CALIB, BATCH):
        variables = {"params": params, **step(variables, x[i : i + BATCH])}
    return variables["quant_stats"]


def run_seed(seed: int, bits_list: list[int], train_set, test_set) -> dict:
    (x, y), (xt, yt) = train_set, test_set
    params = train(x, y, seed)
    ref = predict(CNN(), params, xt)
    row: dict = {"seed": seed, "float": {"accuracy": float(np.mean(ref == yt) * 100)}}
    calib = x[np.random.default_rng(seed).permutation(len(x))[:CALIB]]
    for bits in bits_list:
        ptq_rules = rules(qe.QuantizationRule, bits)
        served = qe.quantize_model(CNN(), qe.PtqProvider(ptq_rules))
        abstract = jax.eval_shape(served.init, jax.random.key(0), x[:1])["params"]
        outs = {"rtn": (served, qe.quantize_params(params, abstract))}
        for name, lib, rule, calibrator, serve in (
            ("gptq", gptq, gptq.GptqRule, gptq.GptqCalibrationProvider, qe.PtqProvider),
            ("awq", awq, awq.AwqRule, awq.AwqCalibrationProvider, awq.AwqInferenceProvider),
        ):
            method_rules = rules(rule, bits)
            stats = calibrate(calibrator(method_rules), params, calib)
            out = lib.quantize_params(params, abstract, stats)
            outs[name] = (qe.quantize_model(CNN(), serve(method_rules)), out)
        for name, (model, out) in outs.items():
            pred = predict(model, out, xt)
            row[f"{name} int{bits}"] = {
                "accuracy": float(np.mean(pred == yt) * 100),
                "agreement": float(np.mean(pred == ref) * 100),
            }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="training seeds 0..N-1")
    parser.add_argument("--bits", default="4,3")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    bits = [int(b) for b in args.bits.split(",") if b]
    train_set, test_set = data()
    start = time.perf_counter()
    rows = [run_seed(s, bits, train_set, test_set) for s in range(args.seeds)]
    mean = {
        k: {m: float(np.mean([r[k][m] for r in rows])) for m in rows[0][k]}
        for k in rows[0]
        if k != "seed"
    }
    result = {
        "machine": f"{platform.machine()} {platform.node()} {jax.devices()[0].platform}",
        "date": time.strftime("%Y-%m-%d"),
        "jax": jax.__version__,
        "train_images": len(train_set[0]),
        "held_out_images": len(test_set[0]),
        "calibration_images": CALIB,
        "seconds": round(time.perf_counter() - start, 1),
        "mean": mean,
        "seeds": rows,
    }
    for k, v in mean.items():
        print(f"{k:10s} " + "  ".join(f"{m} {x:6.2f}" for m, x in v.items()))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
