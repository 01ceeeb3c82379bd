"""LoRA and QLoRA: a trainable low-rank adapter beside a frozen (optionally quantized) weight.

For an op ``y = x · W`` matched by a LoraRule, the provider computes
``y = base(x, W) + (alpha / rank) · (dropout(x) · A) · B`` where ``A`` (``<weight>_lora_a``:
W's contracting axes × rank) starts random and ``B`` (``<weight>_lora_b``: rank × W's output axes)
starts at zero, so the adapted model starts as the base model. For a dot_general the adapters
are stored as the reference stores them, W's batch axes first and the contracting (output) axes
flattened into one: lora_a (*batch, prod(contracting), rank), lora_b (*batch, rank,
prod(output)); an einsum's keep every axis, as there. ``base`` is the PTQ op when the rule
has a weight_qtype (QLoRA: nf4 / int4 base), the float op otherwise.

For a convolution ``y = conv(x, W)`` the adapter is ``conv(dropout(x), A) · B``: ``A`` has W's
layout with the output-feature axis cut to ``rank`` (same window, strides, padding), ``B`` is
rank × output features, applied along the output's feature axis. Grouped convolutions
(feature_group_count / batch_group_count > 1) keep their base only.

In NNX the adapters are flax's ``nnx.LoRAParam`` variables (a subclass of ``nnx.Param``): train
them with ``nnx.state(model, nnx.LoRAParam)`` / ``wrt=nnx.LoRAParam``. In Linen they are params
named as above. Both inherit the base weight's sharding annotation: an axis taken from the weight
keeps its name, the rank axis has none (Linen ``nn.Partitioned`` names; NNX ``out_sharding``).

Dropout (``LoraRule.dropout``, in [0, 1]; 1 drops the adapter entirely) acts on the adapter's
input only, in training: Linen when the caller passes a "dropout" rng; NNX when
apply_lora_to_model got ``rngs``, through an ``nnx.Dropout`` stored as ``<weight>_lora_dropout``
(so ``model.eval()`` turns it off, and its rng state lives in the model like any NNX dropout),
or, as the reference, from ``model.set_attributes(qwix_rngs=nnx.Rngs(dropout=...))`` (every NNX
module with an adapter has a ``qwix_rngs`` slot). Without an rng the adapter is deterministic.
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from qmill.engine.modeling import flax_util
from qmill.engine.modeling import rules as rules_lib
from qmill.engine.providers import model as model_lib
from qmill.engine.providers import ptq

# NNX attribute the reference reads dropout rngs from (set with model.set_attributes).
_USER_RNGS = flax_util.RNGS_ATTR

# NNX variable type of the adapters: flax's own, so nnx.LoRAParam filters find them.
LoRAParam = nnx.LoRAParam


class LoraProvider(ptq.PtqProvider):
    """PTQ (or float) frozen base plus LoRA adapters on the ops the LoraRules match."""

    def __init__(self, rules: Sequence[rules_lib.QuantizationRule] | None = None, **kwargs: Any):
        """``LoraProvider(rules=[LoraRule(...)])`` or ``LoraProvider(rank=..., alpha=...)``.

        Raises:
          ValueError: both rules and LoraRule fields given.
        """
        if rules is None:
            rules = [rules_lib.LoraRule(**kwargs)]
        elif kwargs:
            raise ValueError("pass either rules or LoraRule fields, not both")
        super().__init__(rules)
        self.rngs: nnx.Rngs | None = None  # NNX: set by apply_lora_to_model to init adapters

    def dot_general(
        self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs
    ) -> jax.Array:
        rule, op_id, module = self.current_rule_and_op_id("dot_general")
        if rule is None:
            return jax.lax.dot_general(
                lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs
            )
        ref = flax_util.find_param(rhs, module)
        if rule.weight_qtype is None:
            base = jax.lax.dot_general(
                lhs,
                jax.lax.stop_gradient(rhs),
                dimension_numbers,
                precision,
                preferred_element_type,
            )
        else:
            base = self.quantized_dot_general(rule, op_id, module, lhs, rhs, dimension_numbers)
        (lc, rc), (lb, rb) = dimension_numbers
        if not isinstance(rule, rules_lib.LoraRule) or ref is None:
            return base
        # Batch axes (a batched weight, e.g. one matrix per head) lead both adapters, and the
        # contracting and free axes are flattened, as the reference stores them:
        # lora_a (*batch, prod(contracting), rank), lora_b (*batch, rank, prod(free)).
        nb = len(rb)
        free = [a for a in range(len(rhs.shape)) if a not in rc and a not in rb]
        a, b = self._adapters(module, rule, ref.name, rhs, list(rc), free, list(rb), flat=True)
        a = a.reshape(*(rhs.shape[i] for i in (*rb, *rc)), rule.rank)
        b = b.reshape(*(rhs.shape[i] for i in rb), rule.rank, *(rhs.shape[i] for i in free))
        x = self._dropout(module, rule, ref.name, lhs)
        a_contract = tuple(range(nb, nb + len(rc)))
        batch = tuple(range(nb))
        t = jax.lax.dot_general(x, a, ((tuple(lc), a_contract), (tuple(lb), batch)))
        delta = jax.lax.dot_general(t, b, (((t.ndim - 1,), (nb,)), (batch, batch)))
        return base + (rule.alpha / rule.rank) * delta.astype(base.dtype)

    def einsum(self, einsum_str, *operands, **kwargs) -> jax.Array:
        rule, op_id, module = self.current_rule_and_op_id("einsum")
        if rule is None or not isinstance(einsum_str, str) or len(operands) != 2:
            return jnp.einsum(einsum_str, *operands, **kwargs)
        lhs, rhs = operands
        ref = flax_util.find_param(rhs, module)
        if rule.weight_qtype is None:
            base = jnp.einsum(einsum_str, lhs, jax.lax.stop_gradient(rhs), **kwargs)
        else:
            base = self.quantized_einsum(rule, op_id, module, einsum_str, lhs, rhs)
        ins, out = einsum_str.replace(" ", "").split("->")
        lhs_s, rhs_s = ins.split(",")
        # Batch letters (in both operands and the output) go to lora_a with the contracted
        # ones, as the reference: "bjir,bnmjr->bimn" adapts as "bjir,bjrA,Anm->bimn".
        if not isinstance(rule, rules_lib.LoraRule) or ref is None or "." in ins:
            return base
        # The rank's letter as the reference picks it: "r", else the first free letter.
        used = set(ins + out)
        r = "r" if "r" not in used else sorted(set(string.ascii_letters) - used)[0]
        contract = [i for i, c in enumerate(rhs_s) if c in lhs_s]
        free = [i for i, c in enumerate(rhs_s) if c not in lhs_s]
        a, b = self._adapters(module, rule, ref.name, rhs, contract, free)
        kept = "".join(c for c in lhs_s if c in out)
        x = self._dropout(module, rule, ref.name, lhs)
        c_s, f_s = "".join(rhs_s[i] for i in contract), "".join(rhs_s[i] for i in free)
        if isinstance(module, nnx.Module):
            # The adapters' einsum, kept on the module as the reference does (for debugging).
            setattr(module, f"{ref.name}_lora_einsum_str", f"{lhs_s},{c_s}{r},{r}{f_s}->{out}")
        t = jnp.einsum(f"{lhs_s},{c_s}{r}->{kept}{r}", x, a)
        delta = jnp.einsum(f"{kept}{r},{r}{f_s}->{out}", t, b)
        return base + (rule.alpha / rule.rank) * delta.astype(base.dtype)

    def _adapters(
        self,
        module,
        rule: rules_lib.LoraRule,
        name: str,
        weight,
        contract,
        free,
        batch=(),
        flat=False,
    ):
        """(lora_a, lora_b); `flat`: the contracting axes as one in lora_a and the free ones as
        one in lora_b (named after the first of each), the reference's dot_general layout."""
        shape = tuple(weight.shape)
        dtype = weight.dtype if jnp.issubdtype(weight.dtype, jnp.floating) else jnp.float32
        a_axes = (*batch, *contract, None)  # the weight's axes each adapter axis comes from
        b_axes = (*batch, None, *free)
        a_shape = tuple(rule.rank if i is None else shape[i] for i in a_axes)
        b_shape = tuple(rule.rank if i is None else shape[i] for i in b_axes)
        if flat:
            nb = len(batch)
            a_axes = (*batch, contract[0] if contract else None, None)
            b_axes = (*batch, None, free[0] if free else None)
            a_shape = (*a_shape[:nb], math.prod(a_shape[nb:-1]), rule.rank)
            b_shape = (*b_shape[:nb], rule.rank, math.prod(b_shape[nb + 1 :]))
        names = _sharding_names(module, name)
        a_names = _pick(names, a_axes)
        b_names = _pick(names, b_axes)
        a_init, b_init = rule.lora_a_initializer, rule.lora_b_initializer
        a = self._param(module, f"{name}_lora_a", a_init, a_shape, dtype, a_names, name)
        b = self._param(module, f"{name}_lora_b", b_init, b_shape, dtype, b_names, name)
        return a, b

    def _param(self, module, name, init, shape, dtype, names=None, base=None) -> jax.Array:
        mesh = None if names is None or base is None else _mesh_of(module, base)
        if mesh is not None:
            # The base weight is placed on a mesh: its adapter is placed likewise, as the
            # reference places it (P(None, None, 'in', None) for an HWIO kernel's lora_a).
            placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*names))
            init = _placed(init, placed)
        if isinstance(module, nn.Module):
            if names is not None:
                init = nn.with_partitioning(init, names)
            return module.param(name, init, shape, dtype)
        existing = getattr(module, name, None)
        if existing is None:
            if not hasattr(module, _USER_RNGS):
                # A data slot (not static) so set_attributes(qwix_rngs=nnx.Rngs(...)) may fill it.
                setattr(module, _USER_RNGS, nnx.data(None))
            rngs = self.rngs if self.rngs is not None else nnx.Rngs(0)
            # The annotation (placement, if any, was done above by the initializer).
            meta = {} if names is None else {"out_sharding": names, "eager_sharding": False}
            existing = LoRAParam(init(rngs.params(), shape, dtype), **meta)
            setattr(module, name, existing)
        return existing[...]

    def _dropout(self, module, rule: rules_lib.LoraRule, name: str, x: jax.Array) -> jax.Array:
        if rule.dropout == 0.0:
            return x
        if rule.dropout == 1.0:
            # Everything dropped whatever the rng (nnx.Dropout too): the adapter is off.
            return jnp.zeros_like(x)
        if isinstance(module, nn.Module):
            if not module.has_rng("dropout"):
                return x
            keep = jax.random.bernoulli(module.make_rng("dropout"), 1.0 - rule.dropout, x.shape)
            return jnp.where(keep, x / (1.0 - rule.dropout), 0).astype(x.dtype)
        # The reference's way to give an NNX model dropout rngs after the fact:
        # model.set_attributes(qwix_rngs=nnx.Rngs(dropout=...)).
        user_rngs = getattr(module, _USER_RNGS, None)
        user_rngs = user_rngs if isinstance(user_rngs, nnx.Rngs) else None
        attr = f"{name}_lora_dropout"
        dropout = getattr(module, attr, None)
        if dropout is None:
            if user_rngs is not None:
                return nnx.Dropout(rule.dropout, deterministic=False)(x, rngs=user_rngs)
            if self.rngs is None:
                return x
            dropout = nnx.Dropout(rule.dropout, rngs=self.rngs)
            setattr(module, attr, dropout)
        return dropout(x) if user_rngs is None else dropout(x, rngs=user_rngs)

    def conv_general_dilated(
        self, lhs: Any, rhs: Any, window_strides: Any, padding: Any, *args: Any, **kwargs: Any
    ) -> jax.Array:
        rule, op_id, module = self.current_rule_and_op_id("conv_general_dilated")
        call = ptq._ConvCall.bind(window_strides, padding, *args, **kwargs)
        if rule is None:
            return jax.lax.conv_general_dilated(lhs, rhs, window_strides, padding, *args, **kwargs)
        ref = flax_util.find_param(rhs, module)
        if rule.weight_qtype is not None:
            base = self.quantized_conv_general_dilated(rule, op_id, module, lhs, rhs, call)
        else:
            base = jax.lax.conv_general_dilated(
                lhs, jax.lax.stop_gradient(rhs), window_strides, padding, *args, **kwargs
            )
        grouped = any(
            call.values.get(k, 1) != 1 for k in ("feature_group_count", "batch_group_count")
        )
        if not isinstance(rule, rules_lib.LoraRule) or ref is None or grouped:
            return base
        dn = jax.lax.conv_dimension_numbers(lhs.shape, rhs.shape, call.dimension_numbers)
        out_feature = dn.rhs_spec[0]
        shape = tuple(rule.rank if i == out_feature else n for i, n in enumerate(rhs.shape))
        dtype = rhs.dtype if jnp.issubdtype(rhs.dtype, jnp.floating) else jnp.float32
        names = _sharding_names(module, ref.name)
        a_axes = tuple(None if i == out_feature else i for i in range(rhs.ndim))
        a_init, a_names = rule.lora_a_initializer, _pick(names, a_axes)
        a = self._param(module, f"{ref.name}_lora_a", a_init, shape, dtype, a_names, ref.name)
        b_shape = (rule.rank, rhs.shape[out_feature])
        b_init, b_names = rule.lora_b_initializer, _pick(names, (None, out_feature))
        b = self._param(module, f"{ref.name}_lora_b", b_init, b_shape, dtype, b_names, ref.name)
        x = self._dropout(module, rule, ref.name, lhs)
        conv_kwargs = {k: v for k, v in call.values.items() if k != "dimension_numbers"}
        t = jax.lax.conv_general_dilated(
            x, a, window_strides, padding, dimension_numbers=dn, **conv_kwargs
        )
        channel = dn.out_spec[1]
        delta = jnp.moveaxis(jnp.moveaxis(t, channel, -1) @ b, -1, channel)
        return base + (rule.alpha / rule.rank) * delta.astype(base.dtype)

    def get_intercept_map(self):
        return super().get_intercept_map() | {
            "jax.lax.conv_general_dilated": self.conv_general_dilated
        }


def _sharding_names(module: Any, name: str) -> tuple | None:
    """The base weight's per-axis sharding names (Linen nn.Partitioned / NNX out_sharding)."""
    if isinstance(module, nn.Module):
        value = module.get_variable("params", name)
    else:
        value = getattr(module, name, None)
    # A quantized base (WithAux) carries the annotation on its codes.
    for candidate in (value, getattr(getattr(value, "array", None), "qvalue", None)):
        if isinstance(candidate, nn.Partitioned):
            return tuple(candidate.names)
        if isinstance(candidate, nnx.Variable):
            names = candidate.get_metadata().get("out_sharding")
            if names is not None:
                return tuple(names)
    return None


def _mesh_of(module: Any, name: str) -> Any:
    """The mesh the base weight's value is placed on (a NamedSharding's), or None."""
    value = flax_util.unbox(
        module.get_variable("params", name)
        if isinstance(module, nn.Module)
        else getattr(module, name, None)
    )
    value = getattr(getattr(value, "array", None), "qvalue", value)  # a quantized base
    sharding = getattr(value, "sharding", None)
    return sharding.mesh if isinstance(sharding, jax.sharding.NamedSharding) else None


def _placed(init: Any, sharding: Any) -> Any:
    def placed_init(*args: Any, **kwargs: Any) -> jax.Array:
        return jax.device_put(init(*args, **kwargs), sharding)

    return placed_init


def _pick(names: tuple | None, axes: tuple[int | None, ...]) -> tuple | None:
    """Names for an adapter whose axes come from the weight's `axes` (None: the rank axis)."""
    if names is None:
        return None
    return tuple(None if a is None else names[a] for a in axes)


def apply_lora_to_model(
    model: Any,
    provider: LoraProvider,
    *model_inputs: Any,
    methods: Sequence[str] = ("__call__",),
    rngs: nnx.Rngs | None = None,
    **model_inputs_kwargs: Any,
) -> Any:
    """quantize_model with a LoraProvider; ``rngs`` (NNX) initialises the adapters (seed 0)."""
    provider.rngs = rngs
    return model_lib.quantize_model(
        model, provider, *model_inputs, methods=methods, **model_inputs_kwargs
    )
