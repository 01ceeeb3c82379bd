"""quantize_linen_model: a Linen method runs under its provider only inside a bound module."""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn

import qmill.engine as qe


class _Sine(nn.Module):
    def __call__(self, x):
        return self.sin(x)

    def sin(self, x):
        return jnp.sin(x)


class _AddProvider(qe.QuantizationProvider):
    """sin(x) becomes x + 10 and every quantized method's output gains 100."""

    def get_intercept_map(self):
        return {"jax.numpy.sin": lambda x: x + 10}

    def process_model_output(self, method_name, model_output):
        return model_output + 100


def test_unbound_linen_methods_stay_float_bound_ones_are_quantized() -> None:
    quantized = qe.model.quantize_linen_model(_Sine(), _AddProvider([]), ["sin", "__call__"])
    # Unbound (no init / apply): the float method, as the reference's (0.1.8) wrapper does.
    assert float(quantized.sin(0.0)) == 0.0
    # Bound: intercepted, once, with the output hook of the outermost method.
    assert float(quantized.apply({}, 0.0)) == 110.0
    assert float(quantized.apply({}, 0.0, method="sin")) == 110.0
