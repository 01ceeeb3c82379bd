"""Routing library functions to a provider's handlers while a quantized model runs.

A quantized model calls the same ``jax.lax.dot_general`` (or ``jnp.einsum``, ``nn.Module.param``,
...) as the float model; we swap those attributes for *dispatchers* while any quantized model is
running. A dispatcher calls the handler of the outermost ``intercepted`` block of *its own
thread* that handles the target, and the original function everywhere else, so other threads, and
code running outside a quantized model, are unaffected. A handler's own calls of intercepted
targets reach the blocks opened after its own (as the reference chains interceptors: the one
installed last runs closest to the original), and the originals past the last: a handler falls
back to the float op without recursing into itself.

Patches are reference counted across threads and removed by the last thread to leave, in
``finally``: nothing stays patched after the model returns or raises.

Targets are dotted paths (``"jax.lax.dot_general"``, ``"flax.linen.Module.param"``). A target
that doesn't exist in the installed JAX/Flax (private aliases move between versions) is skipped.

A target that is a plain module-level function (``jax.lax.dot_general``, ``jnp.einsum``) is
also patched in its code, as the reference patches it: the function object itself routes to the
dispatcher, so an alias bound before the model ran (``dot = jax.lax.dot_general``, a
``functools.partial`` of it, a default argument) is intercepted too. Calls that reach the object
from JAX's own modules (``jnp.matmul``'s lowering to ``lax.dot_general``) keep reaching the
original, as before: a handler run inside a JAX-internal jit trace would be cached into it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

Handler = Callable[..., Any]


@dataclasses.dataclass
class _Patch:
    owner: Any  # module or class holding the attribute
    attr: str
    original: Any  # the raw attribute (function, or property on classes)
    owned: bool  # whether owner defined the attribute itself (else it was inherited)
    users: int = 0  # threads currently inside an `intercepted` block using this patch
    code: types.CodeType | None = None  # a code-patched function's own code, restored after


_lock = threading.Lock()
_patches: dict[str, _Patch] = {}


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.stack: list[Mapping[str, Handler]] = []
        self.ids: list[Any] = []  # the Interceptor id of each block (None for a plain map)
        self.suspended = 0
        # Dispatchers see the blocks from this index on: a running handler's own level and the
        # ones before it are hidden from the calls it makes.
        self.floor = 0


@dataclasses.dataclass(frozen=True)
class Interceptor:
    """A target -> handler map with an identity, as the reference's factories return.

    ``wrap`` applies an interceptor once per thread: a wrapped function called while an
    interceptor of the same ``id`` is active runs plainly (without its own transforms).
    """

    mapping: Mapping[str, Handler]
    id: Any = None


_state = _ThreadState()


def resolve(path: str) -> tuple[Any, str] | None:
    """Returns (owner, attribute name) for a dotted path, or None if it does not exist."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for name in parts[i:-1]:
                owner = getattr(owner, name)
            inspect.getattr_static(owner, parts[-1])
        except AttributeError:
            return None
        return owner, parts[-1]
    return None


def _active_handler(path: str) -> tuple[int, Handler] | None:
    """(level, handler) of the first visible block handling ``path``, or None."""
    if _state.suspended:
        return None
    for level in range(_state.floor, len(_state.stack)):
        handler = _state.stack[level].get(path)
        if handler is not None:
            return level, handler
    return None


def _call_handler(level: int, handler: Handler, args: tuple[Any, ...], kwargs: dict) -> Any:
    saved = _state.floor
    _state.floor = level + 1
    try:
        return handler(*args, **kwargs)
    finally:
        _state.floor = saved


def _make_dispatcher(path: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def dispatcher(*args: Any, **kwargs: Any) -> Any:
        found = _active_handler(path)
        if found is None:
            return original(*args, **kwargs)
        return _call_handler(*found, args, kwargs)

    with contextlib.suppress(AttributeError, TypeError):
        functools.update_wrapper(dispatcher, original)
    dispatcher.__qmill_original__ = original  # type: ignore[attr-defined]
    return dispatcher


def _install(path: str) -> None:
    patch = _patches.get(path)
    if patch is None:
        where = resolve(path)
        if where is None:
            return
        owner, attr = where
        original = inspect.getattr_static(owner, attr)
        owned = not isinstance(owner, type) or attr in vars(owner)
        code = None
        if isinstance(original, property):
            replacement: Any = property(_make_dispatcher(path, original.fget))
        elif isinstance(original, staticmethod):
            replacement = staticmethod(_make_dispatcher(path, original.__func__))
        elif _code_patchable(owner, original):
            code = original.__code__
            replacement = _patch_code(path, original)
        else:
            replacement = _make_dispatcher(path, original)
        setattr(owner, attr, replacement)
        patch = _Patch(owner, attr, original, owned, code=code)
        _patches[path] = patch
    patch.users += 1


def _uninstall(path: str) -> None:
    patch = _patches.get(path)
    if patch is None:
        return
    patch.users -= 1
    if patch.users == 0:
        if patch.code is not None:
            _trampolines.pop(id(patch.original.__code__), None)
            patch.original.__code__ = patch.code
            del patch.original.__wrapped__
        if patch.owned:
            setattr(patch.owner, patch.attr, patch.original)
        else:
            delattr(patch.owner, patch.attr)
        del _patches[path]


# id(trampoline code) -> (the trampoline, the dispatcher it calls).
_trampolines: dict[int, tuple[types.CodeType, Callable[..., Any]]] = {}


def _code_patchable(owner: Any, original: Any) -> bool:
    """A module's own plain function without closure variables, not already patched through
    another path (one trampoline per function)."""
    return (
        isinstance(owner, types.ModuleType)
        and isinstance(original, types.FunctionType)
        and not original.__code__.co_freevars
        and id(original.__code__) not in _trampolines
        and "__wrapped__" not in vars(original)  # set while patched, for inspect.signature
    )


def _trampoline(*args: Any, **kwargs: Any) -> Any:
    """The code a patched function runs: the dispatcher registered for this very code object.

    It runs with the patched function's globals (a JAX module's), so it names nothing global:
    builtins only, and this module by its name.
    """
    sys_ = __import__("sys")
    frame = sys_._getframe(0)
    registry = sys_.modules["qmill.engine.modeling.interception"]._trampolines
    dispatcher = registry[id(frame.f_code)][1]
    caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
    if caller == "jax" or caller.startswith("jax."):
        return dispatcher.__qmill_original__(*args, **kwargs)
    return dispatcher(*args, **kwargs)


def _patch_code(path: str, function: types.FunctionType) -> Callable[..., Any]:
    """Routes the calls of ``function`` that reach it directly (aliases) to ``path``'s dispatcher,
    which it returns (for the attribute): both call a copy of the original."""
    copy = types.FunctionType(
        function.__code__,
        function.__globals__,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    for field in ("__kwdefaults__", "__annotations__", "__qualname__", "__module__", "__doc__"):
        setattr(copy, field, getattr(function, field))
    copy.__dict__.update(function.__dict__)
    # A fresh code object per patch: the registry tells which dispatcher it calls.
    code = _trampoline.__code__.replace(co_name=function.__name__)
    dispatcher = _make_dispatcher(path, copy)
    dispatcher.__qmill_function__ = function  # type: ignore[attr-defined] # its identity
    _trampolines[id(code)] = (code, dispatcher)
    function.__code__ = code
    # inspect.signature(function) follows __wrapped__: the original signature while patched.
    function.__wrapped__ = copy  # type: ignore[attr-defined]
    return dispatcher


@contextlib.contextmanager
def intercepted(handlers: Mapping[str, Handler] | Interceptor) -> Iterator[None]:
    """Routes calls of the given targets, made by this thread, to the handlers."""
    interceptor_id = getattr(handlers, "id", None)
    handlers = getattr(handlers, "mapping", handlers)
    paths = list(handlers)
    installed: list[str] = []
    try:
        with _lock:
            for path in paths:
                _install(path)
                installed.append(path)
        _state.stack.append(dict(handlers))
        _state.ids.append(interceptor_id)
        try:
            yield
        finally:
            _state.stack.pop()
            _state.ids.pop()
    finally:
        with _lock:
            for path in installed:
                _uninstall(path)


@contextlib.contextmanager
def nesting(state: threading.local, counter: str) -> Iterator[None]:
    """Counts in ``state.<counter>`` how many blocks of one kind this thread is inside."""
    setattr(state, counter, getattr(state, counter) + 1)
    try:
        yield
    finally:
        setattr(state, counter, getattr(state, counter) - 1)


def suspended() -> contextlib.AbstractContextManager[None]:
    """Within this block, this thread's intercepted targets behave as the originals."""
    return nesting(_state, "suspended")


def is_patched(path: str) -> bool:
    """Whether ``path`` currently holds a dispatcher (used by tests)."""
    with _lock:
        return path in _patches


def current_handler(path: str) -> Handler | None:
    """The handler of ``path`` in this thread's last ``intercepted`` block that has one, or None.

    Unlike the dispatchers this ignores ``suspended``: it answers "which provider is running",
    which a handler may ask too.
    """
    for handlers in reversed(_state.stack):
        if path in handlers:
            return handlers[path]
    return None


def is_active(interceptor_id: Any) -> bool:
    """Whether an Interceptor with this id is active in this thread."""
    return interceptor_id is not None and interceptor_id in _state.ids


def _identity_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    return args, kwargs


def wrap(
    fn: Callable[..., Any],
    get_handlers: Callable[[], Mapping[str, Handler]],
    *,
    input_transform: Callable[[Any, Any], tuple[Any, Any]] = _identity_inputs,
    output_transform: Callable[[Any], Any] = lambda out: out,
    should_intercept: Callable[[], bool] = lambda: True,
    disable_jit: bool = False,
) -> Any:
    """Returns ``fn`` running under ``intercepted(get_handlers())`` at every call.

    Args:
      fn: the function to wrap.
      get_handlers: called at each call for the target -> handler map (or an Interceptor).
      input_transform: (args, kwargs) -> (args, kwargs), applied before ``fn`` runs.
      output_transform: applied to ``fn``'s result, outside the intercepted block.
      should_intercept: when it returns False, ``fn`` runs plainly (no transforms either).
      disable_jit: run ``fn`` with jax.jit disabled, so that jitted library functions run their
        Python code (and reach the handlers) instead of a cached compiled version.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not should_intercept():
            return fn(*args, **kwargs)
        handlers = get_handlers()
        if is_active(getattr(handlers, "id", None)):
            return fn(*args, **kwargs)  # this interceptor already applies (see Interceptor)
        args, kwargs = input_transform(args, kwargs)
        with contextlib.ExitStack() as stack:
            if disable_jit:
                import jax  # here: this module is imported by code that must not need jax

                stack.enter_context(jax.disable_jit())
            stack.enter_context(intercepted(handlers))
            out = fn(*args, **kwargs)
        return output_transform(out)

    return wrapper


# The seeds' name for wrap.
wrap_func_intercepted = wrap


def disable_interceptions(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Returns ``fn`` running with this thread's interceptions off: it reaches the originals."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with suspended():
            return fn(*args, **kwargs)

    return wrapper


def has_attribute(path: str) -> bool:
    """Whether the dotted target exists in the installed libraries."""
    return resolve(path) is not None


class LateBound:
    """A stand-in for a function held by reference, which looks the function up at each call.

    Flax modules keep some functions as attributes bound at construction (``promote_dtype``,
    NNX ``Conv.conv_general_dilated``, ``Einsum.einsum_op``); patching the library attribute
    doesn't reach those copies. Replacing them with a LateBound of the same target makes them
    follow interception, and behave exactly as the original otherwise.
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        where = resolve(self.path)
        assert where is not None, self.path
        return getattr(*where)(*args, **kwargs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LateBound) and other.path == self.path

    def __hash__(self) -> int:
        return hash((LateBound, self.path))

    def __repr__(self) -> str:
        return f"LateBound({self.path!r})"


def late_bind_attributes(obj: Any, originals: Mapping[int, str], *, force: bool = False) -> None:
    """Replaces attributes of ``obj`` that are one of ``originals`` (id -> path) by LateBounds.

    ``force`` sets them with object.__setattr__, for frozen objects (Linen modules).
    """
    for name, value in list(vars(obj).items()):
        path = originals.get(id(value))
        if path is not None:
            if force:
                object.__setattr__(obj, name, LateBound(path))
            else:
                setattr(obj, name, LateBound(path))


def originals_of(paths: Iterator[str] | list[str]) -> dict[int, str]:
    """id(original function) -> path, for the given targets that exist."""
    out: dict[int, str] = {}
    for path in paths:
        where = resolve(path)
        if where is None:
            continue
        raw = inspect.getattr_static(*where)
        raw = getattr(raw, "__qmill_function__", getattr(raw, "__qmill_original__", raw))
        if callable(raw) and not isinstance(where[0], type):
            out[id(raw)] = path
    return out
