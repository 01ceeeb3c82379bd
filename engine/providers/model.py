"""quantize_model: the float model's code, run with a provider's handlers.

Linen: returns a subclass of the model's class whose methods run under interception; init and
apply then create / consume the quantized variables.

NNX: returns a copy of the model (sharing the arrays) whose class is a subclass with intercepted
methods, and runs it once on the given inputs so that weights are quantized (PTQ), statistics
and adapters are created (QT, LoRA), exactly as a Linen ``init`` would.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any, TypeVar

from flax import linen as nn
from flax import nnx

from qmill.engine.modeling import flax_util, interception, provenance
from qmill.engine.providers import base

ModelT = TypeVar("ModelT", nn.Module, nnx.Module)

_PROVIDER_ATTR = "_qmill_provider"
_BASE_CLASS_ATTR = "_qmill_float_class"


class _InitState(threading.local):
    def __init__(self) -> None:
        self.initializing = 0


_init_state = _InitState()


def is_initializing_nnx() -> bool:
    """True while quantize_model runs an NNX model to create its quantized variables."""
    return _init_state.initializing > 0


def _interceptor_id(provider: base.QuantizationProvider) -> tuple[str, int]:
    return ("provider", id(provider))


@contextlib.contextmanager
def _running(provider: base.QuantizationProvider, model: Any) -> Iterator[None]:
    handlers = _handlers(provider)
    originals = interception.originals_of(list(handlers))
    # One block per provider and thread: a quantized method called by another (or by a
    # handler) runs under the block already there, as the reference applies an interceptor once.
    interceptor = interception.Interceptor(handlers, id=_interceptor_id(provider))
    block = (
        contextlib.nullcontext()
        if interception.is_active(interceptor.id)
        else interception.intercepted(interceptor)
    )
    with provenance.tracking(), block:
        if isinstance(model, nnx.Module):
            flax_util.track_module_params(model)
            yield
        else:

            def late_bind(next_fun, args, kwargs, context):
                interception.late_bind_attributes(context.module, originals, force=True)
                return next_fun(*args, **kwargs)

            with nn.intercept_methods(late_bind):
                yield


def _handlers(provider: base.QuantizationProvider) -> dict[str, Callable[..., Any]]:
    """The provider's interceptor maps as one: a later map's handler wins for a target.

    One dispatcher per target serves the innermost block, so several maps are merged rather than
    nested (a nested block would hide the outer map's other targets).
    """
    merged: dict[str, Callable[..., Any]] = {}
    for get_map in provider.get_interceptors():
        handlers = get_map()
        # A factory may return an interception.Interceptor (the reference's form) or a map.
        merged.update(getattr(handlers, "mapping", handlers))
    return merged


def _wrap_method(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self, nn.Module) and self.scope is None:
            # As the reference: a Linen method is quantized only inside a bound module (init,
            # apply); called on an unbound module it is the float method.
            return method(self, *args, **kwargs)
        provider = getattr(type(self), _PROVIDER_ATTR, None) or getattr(self, _PROVIDER_ATTR)
        if interception.is_active(_interceptor_id(provider)):
            # A quantized method called by another runs inside it, as the reference applies
            # an interceptor once: no second input / output hook.
            return method(self, *args, **kwargs)
        # Hooks for providers that quantize the model's inputs / output too (the ODML ones).
        _, args, kwargs = provider.process_model_inputs(self, args, kwargs)
        with _running(provider, self):
            out = method(self, *args, **kwargs)
        hook = getattr(provider, "model_output", None)
        out = out if hook is None else hook(self, out, method.__name__)
        return provider.process_model_output(method.__name__, out)

    return wrapper


def _float_class(cls: type) -> type:
    return getattr(cls, _BASE_CLASS_ATTR, cls)


def _subclass(cls: type, methods: Collection[str], extra: dict[str, Any]) -> type:
    namespace = {name: _wrap_method(getattr(cls, name)) for name in methods}
    namespace[_BASE_CLASS_ATTR] = cls
    namespace["__module__"] = cls.__module__
    namespace["__qualname__"] = cls.__qualname__
    return type(cls.__name__, (cls,), namespace | extra)


# NNX graphdefs compare classes by identity: one subclass per (float class, methods) keeps jit
# caches warm across models; the provider lives on the instance.
_nnx_classes: dict[tuple[type, tuple[str, ...]], type] = {}
_nnx_classes_lock = threading.Lock()


def _nnx_subclass(cls: type, methods: tuple[str, ...]) -> type:
    with _nnx_classes_lock:
        key = (cls, methods)
        if key not in _nnx_classes:
            _nnx_classes[key] = _subclass(cls, methods, {})
        return _nnx_classes[key]


def quantize_model(
    model: ModelT,
    provider: base.QuantizationProvider,
    *model_inputs: Any,
    methods: Collection[str] = ("__call__",),
    **model_inputs_kwargs: Any,
) -> ModelT:
    """Returns ``model`` running under ``provider``: quantized without changing the model's code.

    Args:
      model: a Linen module (unbound) or an NNX module.
      provider: PtqProvider, QtProvider, LoraProvider, ...
      *model_inputs: NNX only, required: inputs for one call that creates the quantized
        variables.
      methods: the model's methods that run quantized.
      **model_inputs_kwargs: NNX only: keyword inputs of that call; ``skip_nnx_init=True``
        skips the call (the variables are then created by the first call of the result);
        ``rngs=nnx.Rngs(...)`` initialises LoRA adapters.

    Returns:
      Linen: a module of a subclass of the model's class. NNX: a new model sharing the arrays;
      the float model is left as it was.
    """
    methods = tuple(methods)
    if isinstance(model, nn.Module):
        if model_inputs or model_inputs_kwargs:
            raise ModelInputsError(
                "Linen models take no inputs here; call init/apply on the quantized model."
            )
        return quantize_linen_model(model, provider, methods)
    if not isinstance(model, nnx.Module):
        raise ModelInputsError(f"expected a Linen or NNX module, got {type(model).__name__}")
    skip_init = bool(model_inputs_kwargs.pop("skip_nnx_init", False))
    # The seeds' rngs= is lent to the modules while the model first runs (flax_util.nnx_rngs:
    # LoRA adapters, params made with need_rng); it is not an input of the model.
    rngs = model_inputs_kwargs.pop("rngs", None)
    if rngs is not None:
        if not isinstance(rngs, nnx.Rngs):
            raise ModelInputsError(f"rngs= must be an nnx.Rngs; got {type(rngs).__name__}.")
        if hasattr(provider, "rngs"):
            provider.rngs = rngs
    if not (model_inputs or model_inputs_kwargs or skip_init):
        raise ModelInputsError(
            "NNX models need example inputs here (quantize_model(model, provider, *inputs)): "
            "they are run once to create the quantized variables. Pass skip_nnx_init=True to "
            "skip that run."
        )
    quantized = _quantize_nnx(model, provider, methods, model_inputs, model_inputs_kwargs, rngs)
    provider.quantization_completed = True
    return quantized


def quantize_linen_model(
    model: nn.Module, provider: base.QuantizationProvider, methods: Collection[str]
) -> nn.Module:
    """The Linen half of quantize_model (the reference's public name): a module of a subclass of
    the model's class whose ``methods`` run under ``provider`` (a quantized model's float class
    is used again, not subclassed twice)."""
    cls = _subclass(_float_class(type(model)), tuple(methods), {_PROVIDER_ATTR: provider})
    provider.quantization_completed = True
    return cls(**_linen_fields(model))


class ModelInputsError(ValueError, TypeError):
    """quantize_model called with inputs it can't use (a ValueError as in the seeds; a TypeError
    as qmill raised before)."""


def _linen_fields(model: nn.Module) -> dict[str, Any]:
    return {
        name: getattr(model, name)
        for name, f in model.__dataclass_fields__.items()
        if f.init and name != "parent"
    }


def _quantize_nnx(model, provider, methods, inputs, kwargs, rngs=None) -> nnx.Module:
    graphdef, state = nnx.split(model)
    new = nnx.merge(graphdef, state)
    # The provider is set on the top module only; its presence marks the model as quantized.
    originals = interception.originals_of(list(_handlers(provider)))
    for path, node in nnx.iter_graph(new):
        if isinstance(node, nnx.Module):
            setattr(node, flax_util.PATH_ATTR, tuple(str(p) for p in path))
            # QT statistics update on every call unless this is True; present on every module so
            # `model.set_attributes(disable_quant_stats_update=..., raise_if_not_found=False)`
            # (the seeds' way to freeze them for evaluation) reaches them all.
            if not hasattr(node, "disable_quant_stats_update"):
                node.disable_quant_stats_update = False
            # A data slot, so set_attributes(qwix_rngs=nnx.Rngs(...)) may fill it later.
            setattr(node, flax_util.RNGS_ATTR, nnx.data(rngs))
            interception.late_bind_attributes(node, originals)
    object.__setattr__(new, "__class__", _nnx_subclass(_float_class(type(new)), methods))
    setattr(new, _PROVIDER_ATTR, provider)
    if inputs or kwargs:
        _init_state.initializing += 1
        try:
            getattr(new, methods[0])(*inputs, **kwargs)
        finally:
            _init_state.initializing -= 1
    # As the reference, the rngs are lent for the first run only; set_attributes lends others.
    new.set_attributes(**{flax_util.RNGS_ATTR: None}, raise_if_not_found=False)
    return new
