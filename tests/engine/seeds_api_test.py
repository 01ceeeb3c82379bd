"""The reference's public API beyond the samples: current rule, param wrappers, interception,
Flax utilities and pre-quantized checkpoints (issue 20), Linen and NNX where both apply."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import qmill.engine as qwix
from qmill.engine import checkpoint_utils, flax_util, interception, qconfig
from tests import random_inputs

x = random_inputs.normal(jax.random.key(0), (4, 16))


class LinenProbe(nn.Module):
    """Asks the utilities from inside its method and returns what they said."""

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (16, 8))
        found = flax_util.find_param(kernel.astype(jnp.float32))
        extra = flax_util.get_or_create_param("extra", lambda: jnp.full((2,), 3.0))
        stat = flax_util.get_or_create_variable("quant_stats", "seen", lambda: jnp.zeros(()))
        key = flax_util.make_rng("noise")
        return x @ kernel, (found, extra, stat.value, key, qconfig.get_current_rule("einsum"))


class NnxProbe(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(16, 8, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        # Only the running module's own params are its weights; a child's are the child's.
        assert flax_util.find_param(self.linear1.kernel[...]) is None
        found = flax_util.find_param(self.linear1.kernel[...], self.linear1)
        extra = flax_util.get_or_create_param("extra", lambda: jnp.full((2,), 3.0))
        stat = flax_util.get_or_create_variable("quant_stats", "seen", lambda: jnp.zeros(()))
        key = flax_util.make_rng("noise")
        return self.linear1(x), (found, extra, stat, key)


def test_flax_utilities_linen():
    out, variables = LinenProbe().init_with_output(
        {"params": jax.random.key(0), "noise": jax.random.key(1)}, x
    )
    found, extra, seen, key, rule = out[1]
    assert found == "kernel" and found.name == "kernel"
    np.testing.assert_array_equal(extra, [3.0, 3.0])
    assert set(variables) == {"params", "quant_stats"} and "extra" in variables["params"]
    assert float(seen) == 0.0 and key.shape == jax.random.key(0).shape
    assert rule is None  # not a quantized model
    with pytest.raises(ValueError, match="no 'noise' rng stream"):
        LinenProbe().init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="no Flax module is running"):
        flax_util.find_param(x)
    assert flax_util.find_param(x, None) is None  # explicitly no module: no weights


def test_flax_utilities_nnx():
    model = NnxProbe(nnx.Rngs(0, noise=1))
    _, (found, extra, stat, key) = model(x)
    assert found == "kernel" and found.owner is model.linear1 is not model
    assert isinstance(model.extra, nnx.Param) and isinstance(stat, qwix.QuantStat)
    np.testing.assert_array_equal(extra, [3.0, 3.0])
    _, (_, _, _, key2) = model(x)
    assert not np.array_equal(jax.random.key_data(key), jax.random.key_data(key2))


def test_update_sharding():
    assert flax_util.update_sharding(("data", "model"), shape=(1, 8)) == (None, "model")
    assert flax_util.update_sharding(("a", "b"), split=[1]) == ("a", "b", None)
    assert flax_util.update_sharding(("a", None, "b", None), merge=[0, 1]) == ("a", "b")
    assert flax_util.update_sharding(("a", "b"), transpose=[1, None, 0]) == ("b", None, "a")
    with pytest.raises(ValueError, match="at most one"):
        flax_util.update_sharding(("a",), split=[0], merge=[0])


def test_get_current_rule_in_quantized_models():
    rules = [qwix.QuantizationRule(op_names=["einsum"], weight_qtype="int8")]
    qmodel = qwix.quantize_model(LinenProbe(), qwix.PtqProvider(rules=rules))
    out, _ = qmodel.init_with_output({"params": jax.random.key(0), "noise": jax.random.key(1)}, x)
    assert out[1][4] is rules[0]
    assert qconfig.get_current_rule("einsum") is None  # outside any quantized model


def test_quantized_param_wrapper_converts_to_an_array():
    rules = [qwix.QuantizationRule(weight_qtype="int8")]
    ptq = qwix.quantize_model(nn.Dense(8), qwix.PtqProvider(rules=rules))
    params = ptq.init(jax.random.key(0), x)["params"]
    w = params["kernel"]
    assert isinstance(w, qwix.WithAux)
    np.testing.assert_array_equal(jnp.asarray(w), qwix.dequantize(w.array))
    np.testing.assert_array_equal(np.asarray(w), np.asarray(qwix.dequantize(w.array)))


def test_unused_rules_reported_before_and_after_a_run():
    head = qwix.QuantizationRule(module_path="head", weight_qtype="int8")
    nowhere = qwix.QuantizationRule(module_path="nowhere", weight_qtype="int4")
    provider = qwix.PtqProvider(rules=[head, nowhere])
    # As the reference (issue 30): asking before quantize_model is an error, not "all unused".
    with pytest.raises(ValueError, match="call `quantize_model` before"):
        provider.get_unused_rules()
    qwix.quantize_model(Stack(nnx.Rngs(0)), provider, x)  # NNX: runs the model once
    assert provider.get_unused_rules() == [nowhere]


def test_interception_wrap_options_and_disable_interceptions():
    calls = []

    def handler(*args, **kwargs):
        calls.append("handled")
        return jnp.zeros(())

    def body(a):
        return jax.numpy.sum(a) + disabled(a)

    disabled = interception.disable_interceptions(lambda a: jax.numpy.sum(a))
    wrapped = interception.wrap(
        body,
        lambda: {"jax.numpy.sum": handler},
        input_transform=lambda args, kwargs: ((args[0] * 2,), kwargs),
        output_transform=lambda out: out + 100,
        disable_jit=True,
    )
    # sum intercepted (0); the disabled call reaches the original sum of the doubled input (6).
    assert float(wrapped(jnp.ones(3))) == 106.0 and calls == ["handled"]
    assert float(body(jnp.ones(3))) == 6.0  # unwrapped: no interception
    off = interception.wrap(body, lambda: {"jax.numpy.sum": handler}, should_intercept=lambda: 0)
    assert float(off(jnp.ones(3))) == 6.0 and calls == ["handled"]
    assert interception.wrap_func_intercepted is interception.wrap
    assert interception.has_attribute("jax.lax.dot_general")
    assert not interception.has_attribute("jax.lax.no_such_op")


class Stack(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _ptq_stack(rules):
    return qwix.quantize_model(Stack(nnx.Rngs(0)), qwix.PtqProvider(rules=rules), x)


def test_prequantized_checkpoint_round_trip():
    rules = [qwix.QuantizationRule(module_path="layers/.*", weight_qtype="int8")]
    source = _ptq_stack(rules)
    checkpoint = nnx.to_pure_dict(nnx.state(source))
    restored = checkpoint_utils.restore_quantization_rules(checkpoint, act_qtype=None)
    assert [r.module_path for r in restored] == ["layers/[^/]+"]
    assert restored[0].weight_qtype == "int8" and restored[0].act_qtype is None
    abstract = nnx.eval_shape(lambda: _ptq_stack(restored))
    # The stored codes and scales are loaded as they are (no requantization).
    nnx.update(abstract, checkpoint_utils.process_prequantized_params(checkpoint, abstract))
    for i in range(2):
        a, b = abstract.layers[i].kernel.array, source.layers[i].kernel.array
        np.testing.assert_array_equal(a.qvalue, b.qvalue)
        np.testing.assert_array_equal(a.scale, b.scale)
    np.testing.assert_array_equal(abstract(x), source(x))
    with pytest.raises(ValueError, match="allow_extra_params"):
        checkpoint_utils.process_prequantized_params({"nope": jnp.ones(2)}, abstract)
    assert (
        checkpoint_utils.process_prequantized_params(
            {"nope": jnp.ones(2)}, abstract, allow_extra_params=True
        )
        == {}
    )


def test_prequantized_checkpoint_other_scheme_and_float_template():
    checkpoint = nnx.to_pure_dict(
        nnx.state(_ptq_stack([qwix.QuantizationRule(weight_qtype="int4")]))
    )
    int4 = checkpoint["head"]["kernel"]["array"]
    int8_model = nnx.eval_shape(lambda: _ptq_stack([qwix.QuantizationRule(weight_qtype="int8")]))
    nnx.update(int8_model, checkpoint_utils.process_prequantized_params(checkpoint, int8_model))
    # int4 codes requantized as the model quantizes (int8): its codes of the int4 values.
    head = int8_model.head.kernel
    expected = qwix.qarray.quantize(qwix.dequantize(qwix.QArray(**int4)), head.how)
    assert head.array.qvalue.dtype == jnp.int8
    np.testing.assert_array_equal(head.array.qvalue, expected.qvalue)
    np.testing.assert_array_equal(head.array.scale, expected.scale)
    # A float model takes the dequantized values.
    float_model = nnx.eval_shape(lambda: Stack(nnx.Rngs(0)))
    nnx.update(float_model, checkpoint_utils.process_prequantized_params(checkpoint, float_model))
    np.testing.assert_array_equal(
        float_model.head.kernel[...], qwix.dequantize(qwix.QArray(**int4))
    )
    with pytest.raises(ValueError, match="quantize_params"):
        checkpoint_utils.process_prequantized_params(
            nnx.to_pure_dict(nnx.state(Stack(nnx.Rngs(0)))), int8_model
        )
    with pytest.raises(TypeError, match="NNX model"):
        checkpoint_utils.process_prequantized_params(checkpoint, {"head": {}})


def test_a_provider_with_several_interceptor_maps():
    calls = []

    class LinearRelu(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.linear1 = nnx.Linear(16, 8, rngs=rngs)

        def __call__(self, v):
            return jax.nn.relu(self.linear1(v))

    class Spy(qwix.PtqProvider):
        """A second map before the numerical one, as the reference's ODML providers stack."""

        def get_interceptors(self):
            relu = {"jax.nn.relu": lambda v: calls.append(v.shape) or jnp.maximum(v, 0)}
            return [lambda: relu, *super().get_interceptors()]

    rules = [qwix.QuantizationRule(module_path="linear1", weight_qtype="int8")]
    model = qwix.quantize_model(LinearRelu(nnx.Rngs(0)), Spy(rules=rules), x)
    model(x)
    assert calls == [(4, 8), (4, 8)]  # the quantize_model call and this one
    assert isinstance(model.linear1.kernel.array, qwix.QArray)  # the numerical map ran too


def test_update_boxed_and_partitioned_ptq_scales():
    boxed = nn.Partitioned(jnp.ones((4, 8)), names=("embed", "mlp"))
    assert flax_util.update_boxed(boxed, jnp.ones((1, 8))).names == (None, "mlp")
    assert flax_util.update_boxed(boxed, jnp.ones((4, 2, 4)), split=[1]).names == (
        "embed",
        "mlp",
        None,
    )
    assert flax_util.update_boxed(boxed, transpose=[1, 0]).names == ("mlp", "embed")
    np.testing.assert_array_equal(flax_util.update_boxed(jnp.ones(2), jnp.zeros(2)), [0, 0])
    # A PTQ weight keeps its box: codes with the kernel's names, scales unsharded where size 1.
    init = nn.with_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
    rules = [qwix.QuantizationRule(weight_qtype="int8")]
    ptq = qwix.quantize_model(nn.Dense(8, kernel_init=init), qwix.PtqProvider(rules=rules))
    kernel = ptq.init(jax.random.key(0), x)["params"]["kernel"]
    assert kernel.array.qvalue.names == ("embed", "mlp")
    assert kernel.array.scale.names == (None, "mlp")


def test_get_and_delete_variable():
    rules = [qwix.QtRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]
    qt_model = qwix.quantize_model(Stack(nnx.Rngs(0)), qwix.QtProvider(rules=rules), x)
    stat = flax_util.get_and_delete_variable(
        "quant_stats", "dot_general0_lhs", module=qt_model.head
    )
    assert int(stat["count"]) == 0 and not hasattr(qt_model.head, "dot_general0_lhs")
    assert flax_util.get_and_delete_variable("quant_stats", "nope", module=qt_model.head) is None


def test_quantize_model_inputs_checked_as_the_seeds_do():
    rules = [qwix.QuantizationRule(weight_qtype="int8")]
    with pytest.raises(ValueError, match="Linen models take no inputs"):
        qwix.quantize_model(nn.Dense(8), qwix.PtqProvider(rules=rules), x)
    with pytest.raises(ValueError, match="NNX models need example inputs"):
        qwix.quantize_model(Stack(nnx.Rngs(0)), qwix.PtqProvider(rules=rules))
    with pytest.raises(ValueError, match="Linen or NNX module"):
        qwix.quantize_model(lambda v: v, qwix.PtqProvider(rules=rules))
    # skip_nnx_init: nothing runs now; the first call quantizes the weights.
    model = qwix.quantize_model(Stack(nnx.Rngs(0)), qwix.PtqProvider(rules=rules), skip_nnx_init=1)
    assert isinstance(model.head.kernel, nnx.Param)
    model(x)
    assert isinstance(model.head.kernel.array, qwix.QArray)
