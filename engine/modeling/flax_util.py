"""Flax plumbing shared by the providers: the running module, its path, and its variables.

Linen and NNX differ in how a module stores variables (scoped collections vs attributes), so each
helper here takes the module and does the right thing for either.

The running module is found from the Python call stack: the innermost frame whose ``self`` is a
Flax module is the module running the op. Unlike a hook on module methods this needs no change
to model classes and survives Flax transforms (nn.scan, nnx.vmap...), which call the same methods.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from qmill.engine.modeling import provenance

PATH_ATTR = "qmill_path"  # NNX: attribute holding a module's path, set by quantize_model.


class QuantStat(nnx.Variable):
    """NNX variable holding a static-range statistic ({"count", "sum_of_..."})."""


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


def get_current_module() -> Any:
    """The Flax module (Linen or NNX) whose method is running the caller.

    Raises:
      ValueError: the caller is not inside a module's method.
    """
    module, _ = current_module_and_call()
    if module is None:
        raise ValueError("no Flax module is running here; call this from a module's method.")
    return module


def get_current_module_path() -> tuple[str, ...]:
    """The path of the running module (NNX: as set by quantize_model)."""
    return module_path(get_current_module())


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


_RUNNING = object()  # find_param's default: the running module


def find_param(array: Any, module: Any = _RUNNING) -> provenance.WeightRef | None:
    """Returns where ``array`` came from if it is (a view of) a parameter of ``module``.

    The result is the param's name (a str, as the seeds return it) carrying its module and the
    views that led to ``array``; None for anything else, and for ``module=None`` (an op outside
    any module has no weights). ``module`` defaults to the running one.
    """
    public = module is _RUNNING
    module = get_current_module() if public else module
    if module is None:
        return None
    ref = provenance.lookup(array)
    if ref is not None:
        return ref if ref.owner is module else None
    params = _direct_params(module)
    for name, value in params:
        if _same(value, array):
            return provenance.WeightRef(module, name)
    if not public:
        return None
    # User code, as the reference: a quantized wrapper's array, then the traced chain, then shape.
    if hasattr(array, "how") and hasattr(array, "array"):
        return find_param(array.array, module)
    return _by_trace(module, params, array) or _by_shape(module, params, array)


def _by_trace(module: Any, params: list[tuple[str, Any]], array: Any) -> Any:
    """Under jit, follows the tracer back through unary ops (astype, reshape, sharding
    constraints...) to a param, as the reference does for user code."""
    by_id = {id(value): name for name, value in params}
    x = array
    while isinstance(x, jax.core.Tracer) and hasattr(x, "parent"):
        if id(x) in by_id:
            return provenance.WeightRef(module, by_id[id(x)])
        parent = x.parent
        if parent is not None and len(parent.in_tracers) == 1:
            x = parent.in_tracers[0]
            continue
        const = x.get_const() if hasattr(x, "get_const") else None
        if const is not None and id(const) in by_id:
            return provenance.WeightRef(module, by_id[id(const)])
        return None
    return None


def _by_shape(module: Any, params: list[tuple[str, Any]], array: Any) -> Any:
    """The reference's last resort for user code: the module's only param of ``array``'s shape
    (two: unknown, None; more: ValueError, as the reference). The providers pass ``module`` and
    never guess: an activation shaped like a weight must not be quantized as one."""
    shape = getattr(array, "shape", None)
    same = [name for name, value in params if getattr(value, "shape", None) == shape]
    if len(same) > 2:
        raise ValueError(f"Multiple candidate params found: {same}")
    return provenance.WeightRef(module, same[0]) if len(same) == 1 else None


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


def update_boxed(
    boxed: Any,
    value: Any = None,
    *,
    split: Collection[int] | None = None,
    merge: Collection[int] | None = None,
    transpose: Sequence[int | None] | None = None,
) -> Any:
    """``value`` (default: the boxed value) in a box like ``boxed``, its axis names following
    the value's axes (see update_sharding): a Linen box's ``names`` / ``mesh_axes`` /
    ``axes_types``, an NNX variable's ``out_sharding`` (a variable given no value is updated in
    place, as the reference). An unboxed array is simply replaced by ``value``.

    Raises:
      ValueError: ``boxed`` is neither a box nor an array.
    """
    follow = functools.partial(update_sharding, split=split, merge=merge, transpose=transpose)
    if isinstance(boxed, nnx.Variable):
        out = boxed if value is None else boxed.copy(value)
        metadata = out.get_metadata()
        # Flax 0.12 names them out_sharding (sharding_names before, as the reference reads).
        for key in ("out_sharding", "sharding_names"):
            names = metadata.get(key)
            if isinstance(names, list | tuple | jax.sharding.PartitionSpec):
                out.set_metadata(key, follow(names, shape=jnp.shape(out.get_value())))
        return out
    if isinstance(boxed, nn.meta.AxisMetadata):
        out = boxed if value is None else boxed.replace_boxed(value)
        shape = jnp.shape(out.unbox())
        for field in ("names", "mesh_axes", "axes_types"):
            axes = getattr(out, field, None)
            if isinstance(axes, list | tuple | jax.sharding.PartitionSpec):
                out = dataclasses.replace(out, **{field: follow(axes, shape=shape)})
        return out
    if not hasattr(boxed, "shape"):
        raise ValueError(f"Unsupported type: {type(boxed)}")
    return boxed if value is None else value


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
    kinds = {"params": nnx.Param, "quant_stats": QuantStat}
    return isinstance(variable, kinds.get(collection, nnx.Variable))


def get_and_delete_variable(collection: str, name: str, *, module: Any = None) -> Any:
    """Reads a variable (unboxed, None if absent) and, in NNX, removes it from the module
    (Linen collections can't shrink mid-apply). ``module`` defaults to the running one."""
    module = get_current_module() if module is None else module
    value = get_variable(module, collection, name)
    if value is not None and isinstance(module, nnx.Module):
        delattr(module, name)
    return value


def get_or_create_param(
    name: str,
    init_fn: Callable[..., Any],
    nnx_param_type: type[nnx.Variable] = nnx.Param,
    *,
    need_rng: bool = False,
    module: Any = None,
) -> Any:
    """Returns the unboxed param ``name`` of the module, creating it with ``init_fn()`` if absent.

    ``need_rng``: ``init_fn`` takes a key (Linen: the "params" stream; NNX: the module's rngs, see
    ``make_rng``). ``module`` defaults to the running one; NNX params are created as
    ``nnx_param_type``.
    """
    module = get_current_module() if module is None else module
    if isinstance(module, nn.Module):
        return unbox(module.param(name, init_fn if need_rng else lambda *_: init_fn()))
    existing = getattr(module, name, None)
    if existing is None:
        value = init_fn(nnx_rngs(module).params()) if need_rng else init_fn()
        # nnx.data: a pytree holding Variables in a new attribute must be declared as data.
        setattr(module, name, nnx.data(jax.tree.map(nnx_param_type, value)))
        return value
    return unbox(existing)


def get_or_create_variable(
    collection: str, name: str, init_fn: Callable[[], Any], *, module: Any = None
) -> Any:
    """The variable ``name`` of ``collection`` in the module (boxed: nn.Variable / nnx.Variable),
    created with ``init_fn()`` if absent. NNX collections map to variable types by name
    ("params" -> nnx.Param, "quant_stats" -> QuantStat, others as nnx registers them)."""
    module = get_current_module() if module is None else module
    if isinstance(module, nn.Module):
        if module.scope is None:
            raise ValueError("the Linen module is not bound; call this inside init/apply.")
        # scope.variable, unlike module.variable, also works outside compact methods.
        return module.scope.variable(collection, name, init_fn)
    kind = _variable_type(collection)
    existing = getattr(module, name, None)
    if existing is None:
        existing = kind(init_fn())
        setattr(module, name, existing)
    elif not isinstance(existing, kind):
        raise ValueError(
            f"{name!r} of the module is a {type(existing).__name__}, not a {kind.__name__} of "
            f"collection {collection!r}; use another name."
        )
    return existing


def _variable_type(collection: str) -> type[nnx.Variable]:
    known = {"params": nnx.Param, "quant_stats": QuantStat}
    if collection in known:
        return known[collection]
    return nnx.variable_type_from_name(collection, allow_register=True)


RNGS_ATTR = "qwix_rngs"  # NNX: the rngs quantize_model(..., rngs=) lends every module


def nnx_rngs(module: nnx.Module) -> nnx.Rngs:
    """The nnx.Rngs an NNX module draws from: ``qwix_rngs`` (set by quantize_model(..., rngs=)
    while it runs the model, or by ``model.set_attributes(qwix_rngs=nnx.Rngs(...))``), else the
    module's own ``rngs`` attribute.

    Raises:
      ValueError: neither is an nnx.Rngs.
    """
    for attr in (RNGS_ATTR, "rngs"):
        rngs = getattr(module, attr, None)
        if isinstance(rngs, nnx.Rngs):
            return rngs
    raise ValueError(
        f"Cannot find rngs in the NNX module {type(module).__name__}: set them with "
        "model.set_attributes(qwix_rngs=nnx.Rngs(...)) (or store an nnx.Rngs as self.rngs)."
    )


def make_rng(rng_stream: str, *, module: Any = None) -> jax.Array:
    """A new key from ``rng_stream`` of the module (Linen: its rngs; NNX: see ``nnx_rngs``).

    Raises:
      ValueError: the module has no such stream.
    """
    module = get_current_module() if module is None else module
    if isinstance(module, nn.Module):
        if not module.has_rng(rng_stream):
            raise ValueError(
                f"no {rng_stream!r} rng stream; pass rngs={{{rng_stream!r}: key}} to init/apply."
            )
        return module.make_rng(rng_stream)
    return nnx_rngs(module)[rng_stream]()


def update_sharding(
    spec: Sequence[Any],
    *,
    shape: Sequence[int] | None = None,
    split: Collection[int] | None = None,
    merge: Collection[int] | None = None,
    transpose: Sequence[int | None] | None = None,
) -> tuple[Any, ...]:
    """A partition spec (one entry per axis) for an array derived from one with ``spec``.

    Args:
      spec: the original array's spec.
      shape: the derived array's shape: axes of size 1 (a scale's reduced axes) get None.
      split: axes split in two (tiling: a -> (a, tile)); each becomes (its entry, None).
      merge: the inverse of split, with the same axes (of the original, unsplit array).
      transpose: the derived array's axes as original axes (None: a new axis, unsharded).

    Raises:
      ValueError: more than one of split / merge / transpose, or a shape of another rank.
    """
    if sum(bool(x) for x in (split, merge, transpose)) > 1:
        raise ValueError("update_sharding takes at most one of split, merge and transpose.")
    # The reference hands back a list given a list when it only drops entries (merge, or
    # nothing to do); a tuple otherwise; a PartitionSpec stays one.
    keep_list = isinstance(spec, list) and not (split or transpose or shape)
    if isinstance(spec, jax.sharding.PartitionSpec):
        return jax.sharding.PartitionSpec(
            *update_sharding(
                tuple(spec), shape=shape, split=split, merge=merge, transpose=transpose
            )
        )
    out = list(spec)
    if split:
        out = [e for i, a in enumerate(spec) for e in ((a, None) if i in split else (a,))]
    elif merge:
        # Axis i of the merged array is followed, in spec, by its tile axis and by one tile axis
        # for each merged axis before it; drop the tile axes.
        drop = {i + n + 1 for n, i in enumerate(sorted(merge))}
        out = [a for j, a in enumerate(spec) if j not in drop]
    elif transpose:
        out = [None if i is None else spec[i] for i in transpose]
    if shape:
        if len(shape) != len(out):
            raise ValueError(f"shape {tuple(shape)} has {len(shape)} axes but the spec {len(out)}.")
        out = [None if d == 1 else a for a, d in zip(out, shape, strict=True)]
    return out if keep_list else tuple(out)


def replace_param(module: Any, name: str, value: Any) -> None:
    """Replaces the param ``name`` with the pytree ``value``, boxed like the old param."""
    if isinstance(module, nn.Module):
        boxed = box_tree(module.get_variable("params", name), value)
        module.put_variable("params", name, boxed)
    else:
        setattr(module, name, nnx.data(box_tree(getattr(module, name), value)))
