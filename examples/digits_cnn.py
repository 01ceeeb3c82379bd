"""An example model for `--model-fn`: a small Flax Linen CNN for 8x8 digit images that no
server's registry knows. Its code stays on your machine; the server gets a program.

    qmill calibrate --server HOST:PORT --model-fn examples/digits_cnn.py:build \
        --params cnn.npz --batches digits.npy --batch-size 32 \
        --stats-output stats.npz --ptq-output ptq.safetensors
    qmill export-odml --server HOST:PORT --model-fn examples/digits_cnn.py:build \
        --params cnn.npz --stats stats.npz --rules w8a8 -o digits.tflite

See docs/remote-models.md. `build()` returns the model and one example batch per input; the
params come from --params (a checkpoint of this model's float params) or a fresh init.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import linen as nn


class DigitsCnn(nn.Module):
    """Conv(16, 3x3) -> Dense(32) -> Dense(10): logits of the ten digits."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(10)(x)


def build() -> dict:
    """The model and an example input (a batch of 8x8 one-channel images)."""
    return {"model": DigitsCnn(), "inputs": (np.zeros((1, 8, 8, 1), np.float32),)}


def init_params(seed: int = 0) -> dict:
    """Float params of a fresh model, as a training script would start from."""
    return DigitsCnn().init(jax.random.key(seed), np.zeros((1, 8, 8, 1), np.float32))["params"]
