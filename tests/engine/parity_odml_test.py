"""Reference behaviours of the ODML providers (issues 30 and 40): Linen shared scopes, the
interception stack, and the statistics' names and sharing, as the reference's odml_test has them
(``final_output0``, jnp.dot as ``dot<n>``, siblings sharing the first one's statistic)."""

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import qmill.engine as qwix
from qmill.engine import interception
from qmill.engine.modeling import provenance
from qmill.engine.providers import odml, odml_names
from tests import random_inputs

RULES = [qwix.QuantizationRule(module_path=".*", weight_qtype="int8", act_qtype="int8")]


def _stat_names(quant_stats) -> set[str]:
    return {"/".join(k[:-1]) for k in flax.traverse_util.flatten_dict(quant_stats)}


class NamedParam(nn.Module):
    features: int
    param_name: str

    @nn.compact
    def __call__(self, x):
        w = self.param(self.param_name, nn.initializers.normal(), (x.shape[-1], self.features))
        return jnp.dot(x, w)


class SharedScope(nn.Module):
    @nn.compact
    def __call__(self, x):
        m1 = NamedParam(features=8, param_name="weight1")
        m2 = NamedParam(features=8, param_name="weight2")
        nn.share_scope(self, m1)  # Gemma 3's pattern: two modules, one variable namespace
        nn.share_scope(self, m2)
        return m2(m1(x))


def test_linen_shared_scope_gives_each_module_its_own_statistics():
    model = qwix.quantize_model(SharedScope(), qwix.OdmlQatProvider(RULES))
    x = random_inputs.normal(jax.random.key(1), (2, 16))
    variables = model.init(jax.random.key(0), x)  # raised NameInUseError before
    # Both ops in the shared scope, numbered apart; jnp.dot is the op "dot", as the reference's.
    assert _stat_names(variables["quant_stats"]) == {"dot0_lhs", "dot1_lhs", "final_output0"}
    # A second run reuses the same statistics, and conversion finds them.
    qat_out, updates = model.apply(variables, x, mutable=["quant_stats"])
    assert _stat_names(updates["quant_stats"]) == _stat_names(variables["quant_stats"])
    stats = updates["quant_stats"]
    conversion = qwix.OdmlConversionProvider(RULES, variables["params"], stats)
    out = qwix.quantize_model(SharedScope(), conversion).apply({"params": variables["params"]}, x)
    np.testing.assert_allclose(out, qat_out, atol=1e-5)


def test_shared_scope_numbering_reuses_indices_on_a_second_call():
    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            m1 = NamedParam(features=16, param_name="weight1")
            m2 = NamedParam(features=16, param_name="weight2")
            nn.share_scope(self, m1)
            nn.share_scope(self, m2)
            return m2(m1(m1(x)))  # m1 twice: its op keeps its index (and its statistic)

    model = qwix.quantize_model(Twice(), qwix.OdmlQatProvider(RULES))
    variables = model.init(jax.random.key(0), jnp.ones((1, 16)))
    assert _stat_names(variables["quant_stats"]) == {"dot0_lhs", "dot1_lhs", "final_output0"}


@pytest.mark.parametrize(
    "provider",
    [
        lambda: qwix.OdmlQatProvider(RULES),
        lambda: qwix.OdmlConversionProvider(RULES, {}, {}),
    ],
    ids=["qat", "conversion"],
)
def test_the_interception_stack_has_two_layers(provider):
    factories = provider().get_interceptors()
    assert len(factories) == 2
    structural, numerical = (f() for f in factories)
    assert isinstance(structural, interception.Interceptor)
    assert structural.id != numerical.id
    # 1. structural: what follows weights through views; 2. numerical: the ops, and no views.
    views = set(provenance.view_handlers())
    assert set(structural.mapping) and set(structural.mapping) <= views
    assert "jax.lax.dot_general" in numerical.mapping
    assert not views & set(numerical.mapping)


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16)(nn.relu(nn.Dense(64)(x)))


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.linear1 = nnx.Linear(16, 64, rngs=rngs)
        self.linear2 = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_statistic_names_as_the_reference(framework):
    # The reference's test_linen / test_nnx: op statistics and the output's "final_output0".
    x = jnp.ones((1, 16))
    if framework == "linen":
        model = qwix.quantize_model(LinenMLP(), qwix.OdmlQatProvider(RULES))
        variables = model.init(jax.random.key(0), x)
        _, updates = model.apply(variables, x, mutable=["quant_stats"])
        names, ops = _stat_names(updates["quant_stats"]), ("Dense_0", "Dense_1")
    else:
        model = qwix.quantize_model(NnxMLP(nnx.Rngs(0)), qwix.OdmlQatProvider(RULES), x)
        model(x)
        stats = nnx.to_pure_dict(nnx.state(model, qwix.QuantStat))
        names, ops = _stat_names(stats), ("linear1", "linear2")
    assert names == {f"{op}/dot_general0_lhs" for op in ops} | {"final_output0"}
    assert odml.MODEL_OUTPUT == "final_output0"


def test_standard_submodules_number_their_dots_apart():
    # The reference's test_linen_no_shared_scope.
    class NoSharedScope(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = NamedParam(features=8, param_name="weight", name="m1")(x)
            return NamedParam(features=8, param_name="weight", name="m2")(x)

    model = qwix.quantize_model(NoSharedScope(), qwix.OdmlQatProvider(RULES))
    variables = model.init(jax.random.key(0), jnp.ones((1, 16)))
    assert _stat_names(variables["quant_stats"]) == {"m1/dot0_lhs", "m2/dot0_lhs", "final_output0"}


def test_several_outputs_and_other_methods_name_their_output_statistics():
    class TwoOutputs(nn.Module):
        def setup(self):
            self.a, self.b = nn.Dense(4), nn.Dense(3)

        def __call__(self, x):
            return self.a(x), self.b(x)

        def encode(self, x):
            return self.a(x)

    x = jnp.ones((2, 8))
    provider = qwix.OdmlQatProvider(RULES)
    model = qwix.quantize_model(TwoOutputs(), provider, methods=["__call__", "encode"])
    variables = model.init(jax.random.key(0), x)
    assert {"final_output0", "final_output1"} <= _stat_names(variables["quant_stats"])
    _, updates = model.apply(variables, x, method="encode", mutable=["quant_stats"])
    assert "encode_output0" in _stat_names(updates["quant_stats"])


class Siblings(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, name="pre_dense")(x)
        return jnp.multiply(nn.Dense(8, name="sibling1")(x), nn.Dense(8, name="sibling2")(x))


def test_sibling_ops_share_the_first_ones_statistic():
    # As the reference: two ops reading one tensor under one rule share one fake quant, and its
    # statistic is the first op's; the exported model has one quantized tensor for both.
    model = qwix.quantize_model(Siblings(), qwix.OdmlQatProvider(RULES))
    x = random_inputs.normal(jax.random.key(1), (4, 8))
    variables = model.init(jax.random.key(0), x)
    provider = qwix.OdmlQatProvider(RULES)
    model = qwix.quantize_model(Siblings(), provider)
    qat_out, updates = model.apply(variables, x, mutable=["quant_stats"])
    stats = updates["quant_stats"]
    assert _stat_names(stats) == {
        "pre_dense/dot_general0_lhs",
        "sibling1/dot_general0_lhs",
        "final_output0",
    }
    conversion = qwix.OdmlConversionProvider(RULES, variables["params"], stats)
    out = qwix.quantize_model(Siblings(), conversion).apply({"params": variables["params"]}, x)
    np.testing.assert_allclose(out, qat_out, atol=1e-5)
    names = [r.name for r in conversion.records.values() if r.kind == "activation"]
    assert sorted(names) == ["pre_dense/dot_general0_lhs", "sibling1/dot_general0_lhs"]
    # A PtqProvider model looks each sibling's statistic up under its own name.
    assert provider.stat_aliases["sibling2/dot_general0_lhs"] == "sibling1/dot_general0_lhs"
    static = [
        qwix.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)
    ]  # what the ODML providers make of RULES
    ptq = qwix.quantize_model(Siblings(), qwix.PtqProvider(static))
    abstract = jax.eval_shape(ptq.init, jax.random.key(0), x)["params"]
    op_stats = odml_names.ptq_stats(stats, provider.stat_aliases)
    params = qwix.quantize_params(variables["params"], abstract, op_stats)
    np.testing.assert_array_equal(
        params["sibling1"]["dot_general0_lhs_scale"].array,
        params["sibling2"]["dot_general0_lhs_scale"].array,
    )
    assert ptq.apply({"params": params}, x).shape == (4, 8)


def test_einsum_and_dense_siblings_share_activation_stats():
    # The reference's test_linen_einsum_and_dense_siblings_share_activation_stats (after 0.1.8;
    # with a weight LiteRT stores per channel: qmill does not flatten (4, D, 8) einsum weights).
    class SiblingModel(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(features=16, name="pre_dense")(x)
            einsum_out = nn.Einsum(
                shape=(x.shape[-1], 8),
                einsum_str="BTD,DH->BTH",
                use_bias=False,
                name="einsum_sibling",
            )(x)
            return einsum_out, nn.Dense(features=8, name="dense_sibling")(x)

    x = jnp.arange(2 * 3 * 16, dtype=jnp.float32).reshape(2, 3, 16)
    x = x / jnp.max(x)
    # (batch, sequence) inputs: one activation scale per tensor, as LiteRT stores it.
    rules = [qwix.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_batch_axes=(0, 1))]
    model = qwix.quantize_model(SiblingModel(), qwix.OdmlQatProvider(rules))
    variables = model.init(jax.random.key(0), x)
    qat_out, updates = model.apply(variables, x, mutable=True)
    variables = {**variables, **updates}
    names = _stat_names(variables["quant_stats"])
    assert "einsum_sibling/einsum0_lhs" in names
    assert "dense_sibling/dot_general0_lhs" not in names
    conversion = qwix.OdmlConversionProvider(rules, variables["params"], variables["quant_stats"])
    out = qwix.quantize_model(SiblingModel(), conversion).apply(variables, x)
    for q, c in zip(qat_out, out, strict=True):
        np.testing.assert_allclose(q, c, atol=1e-5)


def test_jnp_dot_statistics_serve_the_ptq_model_under_its_dot_general_names():
    # ODML calls jnp.dot "dot" (as the reference); PtqProvider routes it through dot_general,
    # numbered with the module's other dot_generals: ptq_stats gives each op its PTQ name.
    class Mixed(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.normal(), (16, 16))
            y = jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())))
            return jnp.dot(jnp.tanh(y), w)

    x = random_inputs.normal(jax.random.key(1), (2, 16))
    provider = qwix.OdmlQatProvider(RULES)
    model = qwix.quantize_model(Mixed(), provider)
    variables = model.init(jax.random.key(0), x)
    _, updates = model.apply(variables, x, mutable=["quant_stats"])
    stats = updates["quant_stats"]
    assert _stat_names(stats) == {"dot_general0_lhs", "dot0_lhs", "final_output0"}
    assert provider.stat_aliases == {
        "dot_general0_lhs": "dot_general0_lhs",
        "dot_general1_lhs": "dot0_lhs",
    }
    static = [qwix.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]
    ptq = qwix.quantize_model(Mixed(), qwix.PtqProvider(static))
    abstract = jax.eval_shape(ptq.init, jax.random.key(0), x)["params"]
    params = qwix.quantize_params(
        variables["params"], abstract, odml_names.ptq_stats(stats, provider.stat_aliases)
    )
    assert {"dot_general0_lhs_scale", "dot_general1_lhs_scale"} <= set(params)
    assert ptq.apply({"params": params}, x).shape == (2, 16)


def test_conversion_reads_calibrations_made_under_the_earlier_names():
    # qmill's calibrations before issue 40 named the output "model_output" and a jnp.dot's input
    # "dot_general<n>_lhs"; the conversion provider still finds them.
    model = qwix.quantize_model(SharedScope(), qwix.OdmlQatProvider(RULES))
    x = random_inputs.normal(jax.random.key(1), (2, 16))
    variables = model.init(jax.random.key(0), x)
    qat_out, updates = model.apply(variables, x, mutable=["quant_stats"])
    stats = dict(updates["quant_stats"])
    old = {
        "dot_general0_lhs": stats["dot0_lhs"],
        "dot_general1_lhs": stats["dot1_lhs"],
        "model_output": stats["final_output0"],
    }
    conversion = qwix.OdmlConversionProvider(RULES, variables["params"], old)
    out = qwix.quantize_model(SharedScope(), conversion).apply({"params": variables["params"]}, x)
    np.testing.assert_allclose(out, qat_out, atol=1e-5)
    assert "final_output0" in conversion.records
