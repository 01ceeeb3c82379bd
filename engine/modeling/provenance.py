"""Which arrays are weights: identity of parameter values, followed through reshapes and friends.

JAX arrays can't carry tags, so while a quantized model runs we keep a per-thread table from
``id(array)`` to the parameter it came from (holding the array so its id can't be reused). A
parameter is entered when a module reads it; views of it made with reshape, transpose, astype,
squeeze, swapaxes, ``.T``... are entered too, with the chain of view names, by handlers on those
functions (public entry points and array methods, because ``jnp`` functions are jitted and an
inner lax call would see a different tracer). An op operand found in the table, owned by the
module running the op, is a weight; anything else is an activation.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from qmill.engine.modeling import interception


class WeightRef(str):
    """Where a weight operand came from: the param's name (as a str) plus its module and views.

    A str so that it is what the seeds' ``find_param`` returns (the param name, compared and
    printed as one); ``owner`` and ``views`` say more for the providers here.
    """

    owner: Any  # the module holding the parameter
    views: tuple[str, ...]  # view ops applied after reading it, in order

    def __new__(cls, owner: Any, name: str, views: tuple[str, ...] = ()) -> WeightRef:
        ref = super().__new__(cls, name)
        ref.owner, ref.views = owner, tuple(views)
        return ref

    @property
    def name(self) -> str:
        """The parameter's attribute / variable name."""
        return str.__str__(self)

    def with_views(self, views: tuple[str, ...]) -> WeightRef:
        return WeightRef(self.owner, self.name, views)


class _State(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.table: dict[int, tuple[Any, WeightRef]] = {}
        # Per module call: op counters, keyed by id of the call's outermost frame (kept alive).
        self.calls: dict[int, tuple[Any, dict[str, int]]] = {}
        # Per variable namespace (a Linen scope, kept alive): the next free index per op kind,
        # and the index given to each (member, op kind, index within the member's call).
        self.spaces: dict[int, tuple[Any, dict[str, int], dict[tuple[Any, str, int], int]]] = {}


_state = _State()


@contextlib.contextmanager
def tracking() -> Iterator[None]:
    """Scope of one top-level model call; the tables are dropped when the outermost one exits."""
    try:
        with interception.nesting(_state, "depth"):
            yield
    finally:
        if _state.depth == 0:
            _state.table.clear()
            _state.calls.clear()
            _state.spaces.clear()


def track(array: Any, ref: WeightRef) -> None:
    if _state.depth and array is not None:
        _state.table[id(array)] = (array, ref)


def lookup(array: Any) -> WeightRef | None:
    entry = _state.table.get(id(array))
    if entry is None or entry[0] is not array:
        return None
    return entry[1]


def next_op_index(call_frame: Any, op_name: str, namespace: Any = None, member: Any = None) -> int:
    """Returns 0, 1, ... for successive ops of one kind within one module call.

    With a ``namespace`` (where the module's variables live) shared by several members (Linen
    modules given one scope by ``nn.share_scope``), each member's ops get indices of their own
    there, so their variables don't collide; a member called again reuses its indices.
    """
    _, counters = _state.calls.setdefault(id(call_frame), (call_frame, {}))
    local = counters.get(op_name, 0)
    counters[op_name] = local + 1
    if namespace is None:
        return local
    _, free, given = _state.spaces.setdefault(id(namespace), (namespace, {}, {}))
    key = (member, op_name, local)
    if key not in given:
        given[key] = free.get(op_name, 0)
        free[op_name] = given[key] + 1
    return given[key]


def _view_handler(view_name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def handler(array: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(array, *args, **kwargs)
            ref = lookup(array)
            if ref is not None:
                views = ref.views if out is array else (*ref.views, view_name)
                track(out, ref.with_views(views))
            return out

        return handler

    return make


# View entry points: name of the view -> dotted targets. Methods of concrete arrays live on
# ArrayImpl, methods of tracers on Tracer (both private homes; missing ones are skipped).
_VIEW_TARGETS: dict[str, tuple[str, ...]] = {
    "reshape": (
        "jax.numpy.reshape",
        "jax.lax.reshape",
        "jax._src.array.ArrayImpl.reshape",
        "jax._src.core.Tracer.reshape",
    ),
    "transpose": (
        "jax.numpy.transpose",
        "jax.numpy.swapaxes",
        "jax.numpy.moveaxis",
        "jax.numpy.matrix_transpose",
        "jax.lax.transpose",
        "jax._src.array.ArrayImpl.transpose",
        "jax._src.array.ArrayImpl.swapaxes",
        "jax._src.array.ArrayImpl.T",
        "jax._src.array.ArrayImpl.mT",
        "jax._src.core.Tracer.transpose",
        "jax._src.core.Tracer.swapaxes",
        "jax._src.core.Tracer.T",
        "jax._src.core.Tracer.mT",
    ),
    "astype": (
        "jax.numpy.asarray",
        "jax.numpy.astype",
        "jax.lax.convert_element_type",
        "jax._src.array.ArrayImpl.astype",
        "jax._src.core.Tracer.astype",
    ),
    "squeeze": (
        "jax.numpy.squeeze",
        "jax.numpy.expand_dims",
        "jax._src.array.ArrayImpl.squeeze",
        "jax._src.core.Tracer.squeeze",
    ),
}


def is_view_target(target: str) -> bool:
    """Whether ``target`` is one of the view entry points view_handlers() handles."""
    return any(target in targets for targets in _VIEW_TARGETS.values())


def view_handlers() -> dict[str, Callable[..., Any]]:
    """Handlers for the view entry points, wrapping each target's original function."""
    handlers: dict[str, Callable[..., Any]] = {}
    for view_name, targets in _VIEW_TARGETS.items():
        for target in targets:
            original = _original(target)
            if original is not None:
                handlers[target] = _view_handler(view_name)(original)
    return handlers


def _original(target: str) -> Callable[..., Any] | None:
    where = interception.resolve(target)
    if where is None:
        return None
    owner, attr = where
    raw = vars(owner).get(attr) if isinstance(owner, type) else getattr(owner, attr)
    if raw is None:  # inherited class attribute
        raw = getattr(owner, attr, None)
    raw = getattr(raw, "__qmill_original__", raw)
    if isinstance(raw, property):
        raw = raw.fget
    raw = getattr(raw, "__qmill_original__", raw)
    return raw
