"""contrib.sparsity.sparsity_module (issue 40): the reference's sparsity_module_test cases, and the
mask held between update steps."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from qmill.engine.contrib.sparsity import sparsity_module
from qmill.engine.core import sparsity


def test_no_sparsity():
    module = sparsity_module.SparsityModule(shape=(), sharding_axes=())
    x = jnp.arange(10, dtype=jnp.float32)
    out_inputs, out_weight = module(x, x)
    np.testing.assert_array_equal(out_inputs, x)
    np.testing.assert_array_equal(out_weight, x)


def test_activation_sparsity():
    rule = sparsity.SparsityRule(activation_sparsity_n=1, activation_sparsity_m=2)
    module = sparsity_module.SparsityModule(shape=(), sharding_axes=(), sparsity_rule=rule)
    weight = jnp.ones(4)
    out_inputs, out_weight = module(jnp.array([1.0, 2.0, 3.0, 4.0]), weight)
    np.testing.assert_array_equal(out_inputs, [0.0, 2.0, 0.0, 4.0])
    np.testing.assert_array_equal(out_weight, weight)


def test_weight_sparsity():
    rule = sparsity.SparsityRule(
        weight_sparsity_n=1, weight_sparsity_m=2, weight_sparsity_start_step=0
    )
    module = sparsity_module.SparsityModule(shape=(4,), sharding_axes=(), sparsity_rule=rule)
    inputs = jnp.ones(4)
    assert module.step.get_value() == 0
    out_inputs, out_weight = module(inputs, jnp.array([1.0, 2.0, 3.0, 4.0]))
    assert module.step.get_value() == 1
    np.testing.assert_array_equal(out_inputs, inputs)
    np.testing.assert_array_equal(out_weight, [0.0, 2.0, 0.0, 4.0])


def test_eval_mode():
    rule = sparsity.SparsityRule(weight_sparsity_n=1, weight_sparsity_m=2, eval_mode=True)
    module = sparsity_module.SparsityModule(shape=(4,), sharding_axes=(), sparsity_rule=rule)
    weight = jnp.array([1.0, 2.0, 3.0, 4.0])
    out_inputs, out_weight = module(jnp.ones(4), weight)
    np.testing.assert_array_equal(out_weight, weight)  # the initial all-true mask
    np.testing.assert_array_equal(out_inputs, jnp.ones(4))
    assert module.step.get_value() == 0


def test_the_mask_moves_only_at_update_steps_also_under_jit():
    rule = sparsity.SparsityRule(
        weight_sparsity_n=1,
        weight_sparsity_m=2,
        weight_sparsity_start_step=1,
        weight_sparsity_update_step=2,
    )
    module = sparsity_module.SparsityModule(shape=(4,), sharding_axes=(), sparsity_rule=rule)
    step = nnx.jit(lambda m, w: m(jnp.ones(4), w)[1])
    a, b = jnp.array([1.0, 2.0, 3.0, 4.0]), jnp.array([2.0, 1.0, 4.0, 3.0])
    np.testing.assert_array_equal(step(module, a), a)  # step 0: before the start, all kept
    np.testing.assert_array_equal(step(module, a), [0.0, 2.0, 0.0, 4.0])  # step 1: update
    np.testing.assert_array_equal(step(module, b), [0.0, 1.0, 0.0, 3.0])  # step 2: held
    np.testing.assert_array_equal(step(module, b), [2.0, 0.0, 4.0, 0.0])  # step 3: update
    assert int(module.step.get_value()) == 4
