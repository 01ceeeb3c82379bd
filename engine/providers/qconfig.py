"""What the seeds import from ``qwix.qconfig``: the rule, the provider interface, the current rule.

``from qmill.engine import qconfig`` then ``qconfig.QuantizationRule(...)`` works as in the seeds.
"""

from __future__ import annotations

from qmill.engine.core.sparsity import SparsityRule as SparsityRule
from qmill.engine.modeling import interception
from qmill.engine.modeling.rules import QuantizationRule as QuantizationRule
from qmill.engine.providers.base import QuantizationProvider as QuantizationProvider

# The target providers register a handler for; see get_current_rule.
CURRENT_RULE_TARGET = "qmill.engine.providers.qconfig.get_current_rule"


def get_current_rule(op_name: str) -> QuantizationRule | None:
    """The rule a quantized model's provider applies to ``op_name`` in the running module.

    None outside a quantized model (and where no rule matches). Model code can call it to ask
    whether, and how, an op it is about to run will be quantized.
    """
    handler = interception.current_handler(CURRENT_RULE_TARGET)
    return None if handler is None else handler(op_name)


__all__ = ["QuantizationProvider", "QuantizationRule", "SparsityRule", "get_current_rule"]
