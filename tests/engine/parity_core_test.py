"""Reference behaviours of the core and its utilities (issue 30): flax_util's params, rngs and
sharding helpers, checkpoint_utils' errors and templates, and QArrays of mx formats holding
their values in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import qmill.engine as qwix
from qmill.engine import checkpoint_utils, flax_util
from tests import random_inputs


def test_get_or_create_param_with_an_rng_linen_and_nnx():
    init = lambda key: random_inputs.normal(key, (2, 3))  # noqa: E731

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x @ flax_util.get_or_create_param("w", init, need_rng=True)

    variables = Linen().init(jax.random.key(0), jnp.ones((1, 2)))
    w = variables["params"]["w"]
    assert w.shape == (2, 3) and float(jnp.abs(w).sum()) > 0

    class Nnx(nnx.Module):
        def __init__(self):
            self.qwix_rngs = nnx.Rngs(params=1)  # what quantize_model(..., rngs=) lends

        def __call__(self, x):
            a = flax_util.get_or_create_param(
                "lora_a", init, nnx_param_type=nnx.LoRAParam, need_rng=True
            )
            return x @ a

    m = Nnx()
    m(jnp.ones((1, 2)))
    assert isinstance(m.lora_a, nnx.LoRAParam)
    np.testing.assert_array_equal(m.lora_a[...], init(nnx.Rngs(params=1).params()))


def test_make_rng_uses_the_rngs_lent_by_quantize_model():
    drawn = []

    class Noisy(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

        def __call__(self, x):
            if getattr(self, "qwix_rngs", None) is not None:
                drawn.append(flax_util.make_rng("dropout"))
            return self.linear(x)

    x = jnp.ones((1, 2))
    model = qwix.quantize_model(
        Noisy(), qwix.PtqProvider([qwix.QuantizationRule(weight_qtype="int8")]), x, rngs=nnx.Rngs(3)
    )
    assert len(drawn) == 1  # the first run drew from the lent rngs (no self.rngs needed)
    np.testing.assert_array_equal(
        jax.random.key_data(drawn[0]), jax.random.key_data(nnx.Rngs(3).dropout())
    )
    # Lent for the first run only, as the reference; set_attributes lends others.
    assert model.qwix_rngs is None
    model.set_attributes(qwix_rngs=nnx.Rngs(4))
    model(x)
    assert len(drawn) == 2
    with pytest.raises(ValueError, match="qwix_rngs"):
        flax_util.make_rng("dropout", module=nnx.Linear(2, 2, rngs=nnx.Rngs(0)))


def test_find_param_falls_back_to_the_only_param_of_that_shape():
    found = []

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.initializers.ones, (2, 3))
            found.append(flax_util.find_param(w * 1.0))  # a new array, not a view we track
            found.append(flax_util.find_param(jnp.ones((5,))))
            return x @ w

    Linen().init(jax.random.key(0), jnp.ones((1, 2)))

    class Nnx(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((2, 3)))

        def __call__(self, x):
            found.append(flax_util.find_param(self.w[...] + 0.0))
            return x @ self.w

    Nnx()(jnp.ones((1, 2)))
    assert found == ["w", None, "w"]


def test_update_sharding_and_update_boxed():
    # merge takes split's arguments (the unsplit axes); a list stays a list, as the reference.
    split = flax_util.update_sharding(("a", "x", "b"), split=[0, 2])
    assert split == ("a", None, "x", "b", None)
    assert flax_util.update_sharding(list(split), merge=[0, 2]) == ["a", "x", "b"]
    assert flax_util.update_sharding(("a", "b"), split=[1]) == ("a", "b", None)
    assert flax_util.update_sharding(["a", "b"], shape=(1, 4)) == (None, "b")
    boxed = nn.Partitioned(jnp.ones((4, 8)), names=("in", "out"))
    out = flax_util.update_boxed(boxed, value=jnp.ones((1, 8)))
    assert out.names == (None, "out")
    mesh_boxed = nn.LogicallyPartitioned(jnp.ones((4, 8)), names=("x", "y"), mesh=None)
    assert flax_util.update_boxed(mesh_boxed, transpose=[1, 0]).names == ("y", "x")
    var = nnx.Param(jnp.ones((4, 8)), out_sharding=("in", "out"), eager_sharding=False)
    same = flax_util.update_boxed(var, transpose=[1, 0])  # no value: updated in place
    assert same is var and var.get_metadata()["out_sharding"] == ("out", "in")
    with pytest.raises(ValueError, match="Unsupported type"):
        flax_util.update_boxed("not an array")


def test_qarray_of_an_mx_format_may_hold_float32_values():
    x = jnp.linspace(-3.0, 3.0, 64).reshape(2, 32)
    q = qwix.quantize(x, "mxfp8", tiled_axes={1: 32})
    wide = qwix.QArray(q.qvalue.astype(jnp.float32), q.scale, qtype="mxfp8")
    assert wide.qtype == "mxfp8"
    np.testing.assert_array_equal(qwix.dequantize(wide), qwix.dequantize(q))
    with pytest.raises(ValueError, match="storage dtype"):
        qwix.QArray(q.qvalue.astype(jnp.int32), q.scale, qtype="mxfp8")


class Pair(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(x)


def _abstract(rules):
    x = jnp.ones((1, 16))
    return nnx.eval_shape(
        lambda: qwix.quantize_model(Pair(nnx.Rngs(0)), qwix.PtqProvider(rules), x)
    )


def test_prequantized_params_errors_say_what_the_reference_says():
    model = _abstract([qwix.QuantizationRule(weight_qtype="int8")])
    entry = {"qvalue": jnp.ones((16, 4), jnp.int8), "scale": jnp.ones((1, 4))}
    with pytest.raises(ValueError, match=r"unsupported quantized leaves \['junk'\]"):
        checkpoint_utils.process_prequantized_params(
            {"head": {"kernel": entry | {"junk": jnp.ones(1)}}}, model
        )
    with pytest.raises(ValueError, match=r"extra parameters.*nope"):
        checkpoint_utils.process_prequantized_params({"nope": jnp.ones(2)}, model)
    # A wrong shape is a ValueError (requantized, or loaded as is), never a TypeError.
    for bad in (
        {"qvalue": jnp.ones((8, 4), jnp.int4), "scale": jnp.ones((1, 4))},
        {"qvalue": jnp.ones((8, 4), jnp.int8), "scale": jnp.ones((1, 4))},
    ):
        with pytest.raises(ValueError, match=r"head/kernel has shape \(8, 4\), expected \(16, 4\)"):
            checkpoint_utils.process_prequantized_params({"head": {"kernel": bad}}, model)


def test_prequantized_params_into_a_plain_dict_template():
    # A model holding its quantized weight as a plain dict (no WithAux), as the reference loads.
    class DictWeight(nnx.Module):
        def __init__(self):
            self.w = nnx.data(
                {"qvalue": jnp.zeros((16, 4), jnp.int8), "scale": jnp.ones((1, 4), jnp.float32)}
            )

    model = DictWeight()
    source = qwix.quantize(
        random_inputs.normal(jax.random.key(1), (16, 4)), "int8", channelwise_axes=[1]
    )
    out = checkpoint_utils.process_prequantized_params(
        {"w": {"qvalue": source.qvalue, "scale": source.scale}}, model
    )
    np.testing.assert_array_equal(out["w"]["qvalue"], source.qvalue)
    np.testing.assert_array_equal(out["w"]["scale"], source.scale)
    # Another scheme (per tensor) is requantized to the template's (per column, from its scale).
    per_tensor = qwix.quantize(qwix.dequantize(source), "int8")
    out = checkpoint_utils.process_prequantized_params(
        {"w": {"qvalue": per_tensor.qvalue, "scale": per_tensor.scale}}, model
    )
    assert out["w"]["scale"].shape == (1, 4)


PAYLOAD = {
    "kernel": {
        "array": {"qvalue": jnp.ones((12, 6), jnp.int8), "scale": jnp.ones((1, 6), jnp.float32)}
    }
}


def test_prequantized_params_reference_templates_and_messages():
    # A param whose value carries an `array` attribute is matched at the full path.
    class WithArrayAttr(jax.ShapeDtypeStruct):
        def __init__(self, shape, dtype, array):
            super().__init__(shape, dtype)
            object.__setattr__(self, "array", array)

    class Attr(nnx.Module):
        def __init__(self):
            sds = jax.ShapeDtypeStruct((12, 6), jnp.float32)
            self.kernel = nnx.Param(WithArrayAttr((12, 6), jnp.float32, sds))

    out = checkpoint_utils.process_prequantized_params(PAYLOAD, Attr())
    assert isinstance(out["kernel"]["array"], jax.Array)
    # The reference's manual dict template: {"array": {"qvalue", "scale"}} of abstract Params.
    manual = nnx.Linear(12, 6, rngs=nnx.Rngs(0))
    manual.kernel = {
        "array": {
            "qvalue": nnx.Param(jax.ShapeDtypeStruct((12, 6), jnp.int8)),
            "scale": nnx.Param(jax.ShapeDtypeStruct((1, 6), jnp.float32)),
        }
    }
    out = checkpoint_utils.process_prequantized_params(PAYLOAD, manual)
    np.testing.assert_array_equal(
        out["kernel"]["array"]["qvalue"], PAYLOAD["kernel"]["array"]["qvalue"]
    )
    # A QT model (float template) takes the dequantized values.
    x = jnp.ones((2, 12))
    rule = qwix.QtRule(weight_qtype="int8", act_qtype="int8", tile_size=4)
    qt_model = nnx.eval_shape(
        lambda: qwix.quantize_model(nnx.Linear(12, 6, rngs=nnx.Rngs(0)), qwix.QtProvider([rule]), x)
    )
    out = checkpoint_utils.process_prequantized_params(PAYLOAD, qt_model)
    np.testing.assert_array_equal(out["kernel"], jnp.ones((12, 6)))
    ptq_model = nnx.eval_shape(
        lambda: qwix.quantize_model(
            nnx.Linear(12, 6, rngs=nnx.Rngs(0)),
            qwix.PtqProvider([qwix.QuantizationRule(weight_qtype="int8")]),
            x,
        )
    )
    with pytest.raises(ValueError, match="Unhandled or invalid parameter combination"):
        checkpoint_utils.process_prequantized_params({"kernel": jnp.ones((12, 6))}, ptq_model)
    with pytest.raises(TypeError, match="NNX models"):
        checkpoint_utils.process_prequantized_params({}, {"params": {}})


def test_flax_util_as_the_reference_in_user_code():
    pspec = jax.sharding.PartitionSpec("a", None, "b")
    out = flax_util.update_sharding(pspec, merge=[0])
    assert isinstance(out, jax.sharding.PartitionSpec) and out == jax.sharding.PartitionSpec(
        "a", "b"
    )
    mesh = jax.make_mesh((1, 1), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        boxed = nn.Partitioned(jnp.ones((4, 8)), names=jax.sharding.PartitionSpec("a", "b"))
        updated = flax_util.update_boxed(boxed, value=jnp.ones((2, 2, 8)), split=[0])
        assert updated.names == jax.sharding.PartitionSpec("a", None, "b")
        param = nnx.Param(jnp.ones((2, 2, 8)), out_sharding=("a", None, "b"))
        merged = flax_util.update_boxed(param, value=jnp.ones((4, 8)), merge=[0])
        assert merged.get_metadata()["out_sharding"] == ("a", "b")
        assert merged[...].shape == (4, 8)
    found = []

    class Linen(nn.Module):
        @nn.compact
        def __call__(self):
            w = self.param("w", nn.initializers.ones, (4, 5), jnp.float32)
            self.param("w2", nn.initializers.ones, (4, 5), jnp.float32)  # same shape: no guess
            found.append(flax_util.find_param(w.astype(jnp.bfloat16)))
            found.append(flax_util.find_param(w.reshape((2, 2, 5))))
            found.append(flax_util.find_param(qwix.WithAux(w, None)))

    variables = jax.jit(Linen().init)(jax.random.key(0))
    jax.eval_shape(Linen().apply, variables)

    class Nnx(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones((4, 5), jnp.float32))
            self.w2 = nnx.Param(jnp.ones((4, 5), jnp.float32))

        def __call__(self):
            found.append(flax_util.find_param(self.w.astype(jnp.bfloat16)))
            found.append(flax_util.find_param(self.w.reshape((2, 2, 5))))

    nnx.jit(Nnx())()
    assert found == ["w"] * 8


def test_prequantized_params_refuse_an_unexpected_zero_point():
    model = _abstract([qwix.QuantizationRule(weight_qtype="int8")])  # symmetric: no zero point
    asym = qwix.quantize(
        random_inputs.normal(jax.random.key(2), (16, 4)),
        "int8",
        channelwise_axes=[1],
        calibration_method="minmax",
    )
    entry = {"qvalue": asym.qvalue, "scale": asym.scale, "zero_point": asym.zero_point}
    with pytest.raises(ValueError, match=r'head/kernel provided an unexpected "zero_point"'):
        checkpoint_utils.process_prequantized_params({"head": {"kernel": entry}}, model)


def test_prequantized_params_place_abstract_mesh_shardings_on_the_active_mesh():
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    spec = jax.sharding.PartitionSpec("x", None)
    abstract = jax.sharding.NamedSharding(mesh.abstract_mesh, spec)

    class Abstract(nnx.Module):
        def __init__(self):
            self.bias = nnx.Param(jax.ShapeDtypeStruct((4, 2), jnp.float32, sharding=abstract))
            qvalue = jax.ShapeDtypeStruct((4, 6), jnp.int8, sharding=abstract)
            self.kernel = nnx.data(
                {
                    "array": {
                        "qvalue": nnx.Param(qvalue),
                        "scale": nnx.Param(jax.ShapeDtypeStruct((1, 6), jnp.float32)),
                    }
                }
            )

    payload = {
        "bias": jnp.ones((4, 2)),
        "kernel": {"array": {"qvalue": jnp.ones((4, 6), jnp.int8), "scale": jnp.ones((1, 6))}},
    }
    with pytest.raises(ValueError, match="requires an active mesh"):
        checkpoint_utils.process_prequantized_params(payload, Abstract())
    with jax.set_mesh(mesh):
        out = checkpoint_utils.process_prequantized_params(payload, Abstract())
    for placed in (out["bias"], out["kernel"]["array"]["qvalue"]):
        assert placed.sharding.mesh == mesh and placed.sharding.spec == spec


def test_prequantized_params_requantize_an_entry_without_the_models_zero_point():
    # Deliberate difference (docs/api-differences.md, process_prequantized_params): the
    # reference refuses a missing zero point; here the symmetric codes are requantized.
    rule = qwix.QuantizationRule(weight_qtype="int8", weight_calibration_method="minmax")
    model = _abstract([rule])
    sym = qwix.quantize(
        random_inputs.normal(jax.random.key(3), (16, 4)), "int8", channelwise_axes=[1]
    )
    out = checkpoint_utils.process_prequantized_params(
        {"head": {"kernel": {"qvalue": sym.qvalue, "scale": sym.scale}}}, model
    )
    stored = out["head"]["kernel"]["array"]
    assert stored["zero_point"] is not None
    requantized = qwix.QArray(stored["qvalue"], stored["scale"], stored["zero_point"], qtype="int8")
    np.testing.assert_allclose(
        qwix.dequantize(requantized), qwix.dequantize(sym), atol=float(sym.scale.max())
    )


def test_use_reciprocal_for_quantization_multiplies_by_the_scales_reciprocal(monkeypatch):
    # The reference's flag (issue 40): x * (1 / scale) in x's dtype instead of x / scale. XLA
    # already multiplies by the reciprocal of a broadcast scale, so the flag shows where the
    # scale has x's own shape (a true division otherwise).
    x = random_inputs.normal(jax.random.key(3), (64, 48), jnp.float32) * 3
    how = qwix.HowToQuantize(qtype="int8", channelwise_axes=(1,))
    scale = jnp.broadcast_to(qwix.qarray.quantize(x, how).scale, x.shape)
    divided = qwix.qarray.quantize_with_scale_zero_point(x, "int8", scale, None)
    # The same conversion to int8 of x * (1 / scale), computed in float32 by numpy (÷ 1 is exact).
    products = jnp.asarray(np.asarray(x) * (np.float32(1) / np.asarray(scale)))
    ones = jnp.ones_like(scale)
    by_reciprocal = qwix.qarray.quantize_with_scale_zero_point(products, "int8", ones, None).qvalue
    assert (by_reciprocal != divided.qvalue).any()  # the inputs tell the two apart
    monkeypatch.setattr(qwix.qarray, "USE_RECIPROCAL_FOR_QUANTIZATION", True)
    q = qwix.qarray.quantize_with_scale_zero_point(x, "int8", scale, None)
    np.testing.assert_array_equal(q.qvalue, by_reciprocal)
    # Dynamic quantization (eager and jitted) takes the flag too.
    per_channel = qwix.qarray.quantize(x, how)
    want = qwix.qarray.quantize_with_scale_zero_point(x, "int8", per_channel.scale, None)
    np.testing.assert_array_equal(per_channel.qvalue, want.qvalue)
    jitted = jax.jit(qwix.qarray.quantize, static_argnums=1)(x, how)
    np.testing.assert_array_equal(jitted.qvalue, want.qvalue)


def test_process_prequantized_params_refuses_a_linen_template_in_the_references_words():
    with pytest.raises(TypeError, match=r"only supports NNX PTQ/QT models\. Got <class"):
        checkpoint_utils.process_prequantized_params({}, nn.Dense(4))


def test_restore_quantization_rules_warns_about_conflicting_rules(caplog):
    int8 = {"qvalue": jnp.ones((4, 4), jnp.int8), "scale": jnp.ones((1, 4))}
    int4 = {"qvalue": jnp.ones((4, 4), jnp.int4), "scale": jnp.ones((1, 4))}
    with caplog.at_level("WARNING"):
        rules = checkpoint_utils.restore_quantization_rules({"mlp": {"a": int8, "b": int4}})
    assert [r.weight_qtype for r in rules] == ["int4"]
    assert "Conflicting quantization rules reconstructed for mlp" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        checkpoint_utils.restore_quantization_rules({"mlp": {"a": int8, "b": int8}})
    assert "Conflicting" not in caplog.text
