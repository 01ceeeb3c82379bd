"""The provider interface: rules, op identification and the handlers every mode shares.

A provider holds the rules and supplies handlers for the intercepted functions (see
interception.py). The handlers ask ``current_rule_and_op_id`` which rule applies to the op being
run, and get a name for it that is stable from call to call (``dot_general0``, ``einsum1``, ...:
the op kind and its index among ops of that kind in the current module call), used to name the
op's static scales and statistics.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from flax import linen as nn
from flax.linen import dtypes as linen_dtypes

from qmill.engine.core import qarray
from qmill.engine.modeling import flax_util, provenance
from qmill.engine.modeling import rules as qrules


class QuantizationProvider:
    """Base class of the providers; subclasses add op handlers in ``get_intercept_map``.

    ``rules`` may be given by position or keyword (``PtqProvider(rules=...)``, as the seeds
    write it); the first matching rule wins.
    """

    # The seeds' flag: run the quantized methods with jax.jit disabled (never needed here, since
    # interception patches attributes rather than code objects; kept for subclasses that set it).
    disable_jit: bool = False

    def __init__(self, rules: Sequence[qrules.QuantizationRule] | None = None) -> None:
        if rules is None:
            raise TypeError(f"{type(self).__name__} needs rules=[QuantizationRule(...), ...].")
        if isinstance(rules, qrules.QuantizationRule):
            raise TypeError("rules must be a sequence of QuantizationRule; wrap the rule in [].")
        for rule in rules:
            if not isinstance(rule, qrules.QuantizationRule):
                raise TypeError(f"rules must hold QuantizationRule objects, got {rule!r}.")
        self._rules = tuple(rules)
        self._used: set[int] = set()
        self._used_lock = threading.Lock()
        # Set by quantize_model: until then "unused" would only mean "not run yet".
        self.quantization_completed = False

    @property
    def rules(self) -> tuple[qrules.QuantizationRule, ...]:
        return self._rules

    def current_rule(self, op_name: str) -> qrules.QuantizationRule | None:
        """The rule for ``op_name`` run by the current module, without counting an op."""
        module, _ = flax_util.current_module_and_call()
        path = "/".join(flax_util.module_path(module)) if module is not None else ""
        return qrules.find_rule(self._rules, path, op_name)[1]

    def get_unused_rules(self) -> list[qrules.QuantizationRule]:
        """Rules that have not matched any op run so far (usually a mistyped module_path).

        Raises:
          ValueError: quantize_model has not been called with this provider yet (as the
            reference: before it, every rule would be reported unused).
        """
        if not self.quantization_completed:
            raise ValueError(
                "Quantization is not completed yet. Please call `quantize_model` before calling "
                "`get_unused_rules`."
            )
        with self._used_lock:
            return [r for i, r in enumerate(self._rules) if i not in self._used]

    def current_rule_and_op_id(
        self, op_name: str
    ) -> tuple[qrules.QuantizationRule | None, str | None, Any]:
        """(rule or None, op id or None, module or None) for an op run by the caller."""
        module, call = flax_util.current_module_and_call()
        path = "/".join(flax_util.module_path(module)) if module is not None else ""
        index, rule = qrules.find_rule(self._rules, path, op_name)
        if index is not None:
            with self._used_lock:
                self._used.add(index)
        op_id = None if call is None else f"{op_name}{op_index(module, call, op_name)}"
        return rule, op_id, module

    # Seeds' spelling, kept for subclasses written against it.
    def _get_current_rule_and_op_id(self, op_name: str) -> tuple[Any, Any]:
        rule, op_id, _ = self.current_rule_and_op_id(op_name)
        return rule, op_id

    def promote_dtype(self, *args: Any, dtype: Any = None, inexact: bool = True) -> list[Any]:
        """Linen's promote_dtype, leaving quantized operands (WithAux, QArray) as they are."""
        return _promote(args, dtype, inexact)

    def nnx_promote_dtype(self, args: Any, /, *, dtype: Any = None, inexact: bool = True) -> Any:
        """NNX's promote_dtype (one tuple argument), leaving quantized operands as they are."""
        return tuple(_promote(tuple(args), dtype, inexact))

    def nn_param(self, module: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        """Linen Module.param: returns the param as usual and remembers that it is a weight."""
        value = module.param(name, *args, **kwargs)
        provenance.track(value, provenance.WeightRef(module, name))
        return value

    def get_intercept_map(self) -> dict[str, Callable[..., Any]]:
        """Dotted target -> handler while a model quantized by this provider runs."""
        return {
            **provenance.view_handlers(),
            # qconfig.CURRENT_RULE_TARGET (qconfig imports this module).
            "qmill.engine.providers.qconfig.get_current_rule": self.current_rule,
            "flax.linen.Module.param": self.nn_param,
            "flax.linen.dtypes.promote_dtype": self.promote_dtype,
            "flax.nnx.nn.dtypes.promote_dtype": self.nnx_promote_dtype,
        }

    def get_interceptors(self) -> list[Callable[[], dict[str, Callable[..., Any]]]]:
        """Factories of the handler maps a quantized method runs under, outermost first.

        One map for every provider here; the seeds let a provider stack several.
        """
        return [self.get_intercept_map]

    def process_model_inputs(
        self, model: Any, model_args: Sequence[Any], model_kwargs: dict[str, Any]
    ) -> tuple[Any, Sequence[Any], dict[str, Any]]:
        """Hook run before a quantized method: returns (model, args, kwargs) unchanged here."""
        return model, model_args, model_kwargs

    def process_model_output(self, method_name: str, model_output: Any) -> Any:
        """Hook run on a quantized method's output: unchanged here (see ``model_output``)."""
        del method_name
        return model_output


class OpsProvider(QuantizationProvider):
    """A provider with a handler for every op qmill quantizes (PTQ, QT and the modes built on
    them): subclasses define ``dot_general``, ``einsum``, ``conv_general_dilated`` and
    ``ragged_dot``; jnp.dot and matmuls are routed to them here."""

    def dot(self, a: Any, b: Any, precision: Any = None, preferred_element_type: Any = None, **kw):
        """jnp.dot, routed through dot_general (rules match it as "dot_general")."""
        if a.ndim == 0 or b.ndim == 0:
            return jnp.dot(a, b, precision=precision, preferred_element_type=None, **kw)
        rhs_contract = 0 if b.ndim == 1 else b.ndim - 2
        dn = (((a.ndim - 1,), (rhs_contract,)), ((), ()))
        return self.dot_general(a, b, dn, precision, preferred_element_type)

    def get_intercept_map(self) -> dict[str, Callable[..., Any]]:
        return super().get_intercept_map() | {
            "jax.lax.conv_general_dilated": self.conv_general_dilated,
            "jax.lax.dot_general": self.dot_general,
            "jax.numpy.dot": self.dot,
            **matmul_targets(self.dot),
            "jax.numpy.einsum": self.einsum,
            "jax.lax.ragged_dot": self.ragged_dot,
        }


def op_index(module: Any, call: Any, counter: str) -> int:
    """The next index of ``counter`` (an op name) in the current call of ``module``."""
    # Linen: variables live in the module's scope, which nn.share_scope gives to several
    # modules; they are told apart by name (clones of one module keep its name).
    scope = getattr(module, "scope", None) if isinstance(module, nn.Module) else None
    return provenance.next_op_index(call, counter, scope, getattr(module, "name", None))


def is_quantized(x: Any) -> bool:
    """Whether x is a quantized operand (QArray, or a container of one such as WithAux)."""
    return isinstance(x, qarray.QArray) or isinstance(getattr(x, "array", None), qarray.QArray)


def _promote(args: tuple[Any, ...], dtype: Any, inexact: bool) -> list[Any]:
    plain = [a for a in args if a is not None and not is_quantized(a)]
    target = linen_dtypes.canonicalize_dtype(*plain, dtype=dtype, inexact=inexact)
    out = []
    for a in args:
        if a is None or is_quantized(a):
            out.append(a)
            continue
        converted = a if getattr(a, "dtype", None) == target else jnp.asarray(a, target)
        ref = provenance.lookup(a)
        if ref is not None and converted is not a:
            provenance.track(converted, ref.__class__(ref.owner, ref.name, (*ref.views, "astype")))
        out.append(converted)
    return out


def matmul_targets(dot: Callable[..., Any]) -> dict[str, Callable[..., Any]]:
    """Handlers for ``x @ w`` / jnp.matmul: 2-D right operands go through ``dot``.

    jnp.matmul is jitted, so its inner dot_general sees new tracers and can't tell weights apart;
    it is intercepted at the entry instead. Batched matmuls (rhs ndim > 2) stay unquantized.
    """

    def matmul(a: Any, b: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(b, "ndim", 0) == 2 and getattr(a, "ndim", 0) >= 1 and not args and not kwargs:
            return dot(a, b)
        return jnp.matmul(a, b, *args, **kwargs)

    return {
        "jax.numpy.matmul": matmul,
        "jax._src.array.ArrayImpl.__matmul__": matmul,
        "jax._src.core.Tracer.__matmul__": matmul,
    }
