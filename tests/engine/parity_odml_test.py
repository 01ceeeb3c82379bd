"""Reference behaviours of the ODML providers (issue 30): Linen shared scopes, the interception
stack, and the statistics' names and sharing (two documented differences)."""

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
from qmill.engine.providers import odml

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
    x = jax.random.normal(jax.random.key(1), (2, 16))
    variables = model.init(jax.random.key(0), x)  # raised NameInUseError before
    # Both ops in the shared scope, numbered apart (jnp.dot counts as dot_general here).
    assert _stat_names(variables["quant_stats"]) == {
        "dot_general0_lhs",
        "dot_general1_lhs",
        odml.MODEL_OUTPUT,
    }
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
    assert _stat_names(variables["quant_stats"]) == {
        "dot_general0_lhs",
        "dot_general1_lhs",
        odml.MODEL_OUTPUT,
    }


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
def test_statistic_names_as_the_reference_but_the_output(framework):
    # The op statistics have the reference's names. Deliberate difference
    # (docs/api-differences.md, ODML statistics): the model output's is "model_output", where
    # the reference writes "final_output0".
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
    assert names == {f"{op}/dot_general0_lhs" for op in ops} | {"model_output"}
    assert odml.MODEL_OUTPUT == "model_output" and "final_output0" not in names


class Siblings(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, name="pre_dense")(x)
        return jnp.multiply(nn.Dense(8, name="sibling1")(x), nn.Dense(8, name="sibling2")(x))


def test_sibling_ops_keep_equal_statistics_of_their_own():
    # Deliberate difference (docs/api-differences.md, ODML statistics): the reference records
    # one statistic for two ops reading one tensor under one rule (sibling1's); here each op
    # keeps its own, equal ones, which PTQ's quantize_params looks up by op.
    model = qwix.quantize_model(Siblings(), qwix.OdmlQatProvider(RULES))
    x = jax.random.normal(jax.random.key(1), (4, 8))
    variables = model.init(jax.random.key(0), x)
    qat_out, updates = model.apply(variables, x, mutable=["quant_stats"])
    stats = updates["quant_stats"]
    assert {"sibling1/dot_general0_lhs", "sibling2/dot_general0_lhs"} <= _stat_names(stats)
    for key in ("count", "sum_of_absmax"):
        np.testing.assert_array_equal(
            stats["sibling1"]["dot_general0_lhs"][key], stats["sibling2"]["dot_general0_lhs"][key]
        )
    conversion = qwix.OdmlConversionProvider(RULES, variables["params"], stats)
    out = qwix.quantize_model(Siblings(), conversion).apply({"params": variables["params"]}, x)
    np.testing.assert_allclose(out, qat_out, atol=1e-5)
    static = [
        qwix.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)
    ]  # what the ODML providers make of RULES
    ptq = qwix.quantize_model(Siblings(), qwix.PtqProvider(static))
    abstract = jax.eval_shape(ptq.init, jax.random.key(0), x)["params"]
    op_stats = {k: v for k, v in stats.items() if k != odml.MODEL_OUTPUT}
    params = qwix.quantize_params(variables["params"], abstract, op_stats)
    # Equal statistics give the siblings equal static scales (their own, under their own names).
    np.testing.assert_array_equal(
        params["sibling1"]["dot_general0_lhs_scale"].array,
        params["sibling2"]["dot_general0_lhs_scale"].array,
    )
    assert ptq.apply({"params": params}, x).shape == (4, 8)
