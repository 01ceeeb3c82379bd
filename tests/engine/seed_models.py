"""The MLP of the seeds' "Get Started" page (Linen and NNX), as the samples define it, and its
input: shared by the sample tests and the checkpoint load tests that feed it qmill outputs."""

import jax
from flax import linen as nn
from flax import nnx

from tests import random_inputs


class LinenMLP(nn.Module):
    dhidden: int
    dout: int

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.dhidden, use_bias=False)(x)
        x = nn.relu(x)
        x = nn.Dense(self.dout, use_bias=False)(x)
        return x


class NnxMLP(nnx.Module):
    def __init__(self, din, dhidden, dout, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dhidden, use_bias=False, rngs=rngs)
        self.linear2 = nnx.Linear(dhidden, dout, use_bias=False, rngs=rngs)

    def __call__(self, x):
        x = self.linear1(x)
        x = nnx.relu(x)
        x = self.linear2(x)
        return x


MODEL_INPUT = random_inputs.uniform(jax.random.key(0), (8, 16))
