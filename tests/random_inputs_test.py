"""tests/random_inputs.py draws what jax.random draws, bit for bit (a 2-D shape shows the row-major
numbering; higher ranks compile for seconds, which is what the module saves)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import random_inputs


def _bits(x: jax.Array) -> tuple:
    x = np.asarray(x)
    return x.dtype, x.shape, x.tobytes()


@pytest.mark.parametrize(("shape", "dtype"), [((5, 7), jnp.float32), ((9,), jnp.bfloat16)])
def test_draws_equal_jax_random_of_the_same_shape(shape, dtype):
    key = jax.random.key(3)
    assert _bits(random_inputs.normal(key, shape, dtype)) == _bits(
        jax.random.normal(key, shape, dtype)
    )
    assert _bits(random_inputs.uniform(key, shape, dtype, -0.5, 2.0)) == _bits(
        jax.random.uniform(key, shape, dtype, -0.5, 2.0)
    )


def test_a_raw_key_and_a_traced_draw_give_the_same_numbers():
    key = jax.random.PRNGKey(1)  # the legacy uint32 key
    expected = _bits(jax.random.normal(key, (5, 7)))
    assert _bits(random_inputs.normal(key, (5, 7))) == expected
    assert _bits(jax.jit(lambda k: random_inputs.normal(k, (5, 7)))(key)) == expected
