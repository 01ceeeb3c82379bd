"""Flax plumbing shared by the providers: the running module, its path, and its variables.

Linen and NNX differ in how a module stores variables (scoped collections vs attributes), so each
helper here takes the module and does the right thing for either.

The running module is found from the Python call stack: the innermost frame whose ``self`` is a
Flax module is the module running the op. Unlike a hook on module methods this needs no change
to model classes and survives Flax transforms (nn.scan, nnx.vmap...), which call the same methods.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import linen as nn
from flax import nnx

from qmill.engine import provenance

PATH_ATTR = "qmill_path"  # NNX: attribute holding a module's path, set by quantize_model.


def _frame_module(frame: Any) -> Any:
    module = frame.f_locals.get("self") if "self" in frame.f_code.co_varnames else None
    if isinstance(module, nnx.Module):
        return module
    if isinstance(module, nn.Module) and module.scope is not None:
        return module
    return None


def current_module_and_call() -> tuple[Any, Any]:
    """Returns (module running the caller, outermost frame of that module call) or (None, None).

    The call frame identifies one call of the module: ops are numbered per call, so a module
    called twice reuses its op names (and its parameters) as a Flax module reuses its params.
    """
    frame = sys._getframe(1)
    module, call_frame = None, None
    while frame is not None:
        found = _frame_module(frame)
        if found is not None:
            if module is None:
                module = found
            elif found is not module:
                break
            call_frame = frame
        frame = frame.f_back
    return module, call_frame


def module_path(module: Any) -> tuple[str, ...]:
    if isinstance(module, nn.Module):
        return tuple(str(p) for p in module.path)
    return tuple(getattr(module, PATH_ATTR, ()))


def unbox(value: Any) -> Any:
    """Strips Linen AxisMetadata boxes and NNX variables, leaving the raw pytree."""
    value = nn.meta.unbox(value)
    return jax.tree.map(
        lambda v: v.get_value() if isinstance(v, nnx.Variable) else v,
        value,
        is_leaf=lambda v: isinstance(v, nnx.Variable),
    )


def find_param(array: Any, module: Any) -> provenance.WeightRef | None:
    """Returns where ``array`` came from if it is (a view of) a parameter of ``module``."""
    ref = provenance.lookup(array)
    if ref is not None:
        return ref if ref.owner is module else None
    for name, value in _direct_params(module):
        if _same(value, array):
            return provenance.WeightRef(module, name)
    return None


def _same(param: Any, array: Any) -> bool:
    # A quantized param (WithAux) is re-created on every read; its leaves are not.
    if param is array:
        return True
    if hasattr(param, "how") and hasattr(array, "how"):
        leaves, other = jax.tree.leaves(param), jax.tree.leaves(array)
        return bool(leaves) and len(leaves) == len(other) and leaves[0] is other[0]
    return False


def _direct_params(module: Any) -> list[tuple[str, Any]]:
    if isinstance(module, nn.Module):
        params = module.variables.get("params", {})
        return [(k, nn.meta.unbox(v)) for k, v in params.items() if not isinstance(v, Mapping)]
    return [
        (k, unbox(v))
        for k, v in vars(module).items()
        if isinstance(v, nnx.Param) or (hasattr(v, "how") and hasattr(v, "array"))
    ]


def track_module_params(model: nnx.Module) -> None:
    """NNX: enters every float parameter of the model into the provenance table."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            for name, value in _direct_params(node):
                if isinstance(value, jax.Array | jax.ShapeDtypeStruct):
                    provenance.track(value, provenance.WeightRef(node, name))
        del path


def update_boxed(boxed: Any, value: Any) -> Any:
    """Puts ``value`` in a box like ``boxed`` with its metadata."""
    if isinstance(boxed, nnx.Variable):
        return boxed.copy(value)
    if isinstance(boxed, nn.meta.AxisMetadata):
        return boxed.replace_boxed(value)
    return value


def box_tree(template: Any, tree: Any) -> Any:
    """Boxes every leaf of ``tree`` like ``template`` (a boxed param), e.g. QArray leaves."""
    return jax.tree.map(lambda leaf: update_boxed(template, leaf), tree)


def get_variable(module: Any, collection: str, name: str) -> Any:
    """The (unboxed) variable, or None."""
    if isinstance(module, nn.Module):
        if not module.has_variable(collection, name):
            return None
        return unbox(module.get_variable(collection, name))
    value = getattr(module, name, None)
    wrong_kind = isinstance(value, nnx.Variable) and not _in_collection(value, collection)
    if value is None or wrong_kind:
        return None
    return unbox(value)


def _in_collection(variable: nnx.Variable, collection: str) -> bool:
    from qmill.engine.providers import qt  # cycle: QuantStat is defined by the QT provider

    kinds = {"params": nnx.Param, "quant_stats": qt.QuantStat}
    return isinstance(variable, kinds.get(collection, nnx.Variable))


def get_and_delete_variable(module: Any, collection: str, name: str) -> Any:
    """Reads a variable and, in NNX, removes it (Linen collections can't shrink mid-apply)."""
    value = get_variable(module, collection, name)
    if value is not None and isinstance(module, nnx.Module):
        delattr(module, name)
    return value


def get_or_create_param(module: Any, name: str, init: Callable[[], Any]) -> Any:
    """Returns the unboxed param ``name`` of the module, creating it with ``init()`` if absent."""
    if isinstance(module, nn.Module):
        return unbox(module.param(name, lambda *_: init()))
    existing = getattr(module, name, None)
    if existing is None:
        value = init()
        # nnx.data: a pytree holding Variables in a new attribute must be declared as data.
        setattr(module, name, nnx.data(jax.tree.map(nnx.Param, value)))
        return value
    return unbox(existing)


def replace_param(module: Any, name: str, value: Any) -> None:
    """Replaces the param ``name`` with the pytree ``value``, boxed like the old param."""
    if isinstance(module, nn.Module):
        boxed = box_tree(module.get_variable("params", name), value)
        module.put_variable("params", name, boxed)
    else:
        setattr(module, name, nnx.data(box_tree(getattr(module, name), value)))
