import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn

import qmill.engine as qe
from qmill.engine.modeling import rules


def test_full_match_and_first_rule_wins():
    rs = [
        rules.QuantizationRule(module_path="enc/.*", weight_qtype="int4"),
        rules.QuantizationRule(module_path=".*", weight_qtype="int8"),
    ]
    assert rules.find_rule(rs, "enc/layer0", "dot_general") == (0, rs[0])
    assert rules.find_rule(rs, "xenc/layer0", "dot_general") == (1, rs[1])  # full match only
    assert rules.find_rule(rs[:1], "enc", "einsum") == (None, None)


@pytest.mark.parametrize("pattern", [r"(a)\1", "enc(?=/)", "(?<!x)dense", "(?!enc).*"])
def test_module_path_regexes_needing_backtracking_are_refused(pattern):
    with pytest.raises(ValueError, match=r"linear time \(RE2\).*rewrite the pattern"):
        rules.QuantizationRule(module_path=pattern)


def test_module_path_full_match_in_linear_time():
    r = rules.QuantizationRule(module_path="Dense_0|layers_[0-9]+/mlp", weight_qtype="int8")
    assert r.matches("Dense_0", "dot_general") and r.matches("layers_12/mlp", "einsum")
    assert not r.matches("Dense_01", "dot_general") and not r.matches("x/Dense_0", "einsum")
    assert not r.matches("layers_1/mlp/out", "einsum")
    # Nested quantifiers: exponential backtracking in Python's re for this path (2**64 ways to
    # split the a's), linear in RE2, so this returns at once.
    slow = rules.QuantizationRule(module_path="(a+)+", weight_qtype="int8")
    assert not slow.matches("a" * 64 + "b", "dot_general")
    assert slow.matches("a" * 64, "dot_general")


def test_op_names():
    r = rules.QuantizationRule(op_names=["einsum"], weight_qtype="int8")
    assert r.op_names == ("einsum",) and hash(r)
    assert r.matches("a", "einsum") and not r.matches("a", "dot_general")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"act_qtype": "int8"}, "needs a weight_qtype"),
        ({"weight_qtype": "int8", "act_static_scale": True}, "act_qtype is None"),
        ({"module_path": "("}, "not a valid regex"),
        ({"op_names": "einsum"}, "must be a collection"),
        ({"weight_qtype": "int8", "tile_size": 0}, "positive"),
    ],
)
def test_invalid_rules_refused(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        rules.QuantizationRule(**kwargs)


def test_qt_and_lora_rule_checks():
    with pytest.raises(ValueError, match="bwd_qtype"):
        rules.QtRule(weight_qtype="int8", bwd_stochastic_rounding="uniform")
    with pytest.raises(ValueError, match="bwd_stochastic_rounding"):
        rules.QtRule(weight_qtype="int8", bwd_qtype="int8", bwd_stochastic_rounding="up")
    with pytest.raises(ValueError, match="rank"):
        rules.LoraRule(rank=0, alpha=1.0)
    assert rules.LoraRule(rank=2, alpha=1.0, dropout=1.0).dropout == 1.0  # as nnx.Dropout
    for bad in (1.5, -0.1):
        with pytest.raises(ValueError, match="dropout"):
            rules.LoraRule(rank=2, alpha=1.0, dropout=bad)


def test_unused_rules_reported():
    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(4, name="dense")(x)

    used = rules.QuantizationRule(module_path="dense", weight_qtype="int8")
    typo = rules.QuantizationRule(module_path="dnese", weight_qtype="int4")
    provider = qe.PtqProvider([typo, used])
    with pytest.raises(ValueError, match="Quantization is not completed yet"):
        provider.get_unused_rules()
    qe.quantize_model(M(), provider).init(jax.random.key(0), jnp.ones((1, 3)))
    assert provider.get_unused_rules() == [typo]
