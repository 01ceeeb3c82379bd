"""The ODML providers' statistic names, as the reference's, and their PTQ counterparts.

Lingo:
  op id        ``<op><n>``: the op kind and its index among ops of that kind in one module call.
               The ODML providers name jnp.dot ``dot`` (the reference's ODML op), where PTQ and
               QT route it through dot_general (``dot_general<n>``, counted with dot_generals).
  siblings     ops that read one activation tensor under one rule. As in the reference, the
               first one fake-quantizes it and records its statistic; the others reuse that fake
               quant (one quantized tensor in the exported model) and record none.
  PTQ name     the statistic path a PtqProvider model (quantize_params, the calibrator service's
               static scales) looks up for an op input: ``<module>/dot_general<n>_lhs`` for a
               jnp.dot, every sibling its own. ``stat_aliases`` maps each PTQ name to the ODML
               statistic that holds its range; ``ptq_stats`` re-keys a quant_stats tree with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax

from qmill.engine.modeling import flax_util
from qmill.engine.providers import base
from qmill.engine.providers import odml_boundary as boundary

# Ops the PTQ provider numbers together as dot_general (its jnp.dot is a dot_general).
_PTQ_DOT_OPS = frozenset({"dot", "dot_general"})
_PTQ_DOT_COUNTER = "\0ptq-dot_general"


class OpId(str):
    """An ODML op id (``dot0``) that also carries the PTQ provider's id of the same op."""

    ptq: str

    def __new__(cls, op_id: str, ptq: str) -> OpId:
        new = super().__new__(cls, op_id)
        new.ptq = ptq
        return new


def with_ptq_id(op_name: str, op_id: str | None, module: Any) -> str | None:
    """``op_id`` carrying the PTQ id of the same op (call right after numbering the op)."""
    if op_id is None or op_name not in _PTQ_DOT_OPS:
        return op_id
    _, call = flax_util.current_module_and_call()
    if call is None:
        return op_id
    return OpId(op_id, f"dot_general{base.op_index(module, call, _PTQ_DOT_COUNTER)}")


def ptq_id(op_id: str) -> str:
    return getattr(op_id, "ptq", op_id)


def join(module: Any, name: str) -> str:
    return "/".join((*flax_util.module_path(module), name))


class SharedInputs(threading.local):
    """Fake quants of activations within one model call, reused by sibling ops (per thread)."""

    def __init__(self) -> None:
        # id(x) -> (x, key, fake quant of x, its statistic's path or None).
        self.entries: dict[int, tuple[Any, Any, jax.Array, str | None]] = {}

    def reset(self) -> None:
        self.entries = {}

    def get_or_make(
        self, x: jax.Array, key: Any, stat_path: str | None, make: Callable[[], jax.Array]
    ) -> tuple[jax.Array, str | None]:
        """(fake quant of x, path of the statistic it was made with): a sibling's if an op read
        x under the same key (rule and how) earlier in this call, else ``make()``'s."""
        hit = self.entries.get(id(x))
        if hit is not None and hit[0] is x and hit[1] == key:
            return hit[2], hit[3]
        fq = make()
        self.entries[id(x)] = (x, key, fq, stat_path)
        return fq, stat_path


def ptq_stats(quant_stats: Mapping[str, Any], stat_aliases: Mapping[str, str]) -> dict[str, Any]:
    """An ODML calibration's quant_stats keyed as a PtqProvider model looks them up.

    Args:
      quant_stats: the pure-dict statistics of OdmlQatProvider.
      stat_aliases: the provider's ``stat_aliases`` after a run of the model ({PTQ path: ODML
        path}); empty: the op statistics as they are (a calibration by QtProvider).

    Returns:
      The op statistics (no model input / output ones), each under every PTQ name it serves.
    """
    if not stat_aliases:
        return {k: v for k, v in quant_stats.items() if not boundary.is_boundary_stat(k)}
    out: dict[str, Any] = {}
    for ptq_path, path in stat_aliases.items():
        node = quant_stats
        for key in path.split("/"):
            node = node[key]
        *parents, leaf = ptq_path.split("/")
        target = out
        for key in parents:
            target = target.setdefault(key, {})
        target[leaf] = node
    return out


def aliases_by_stat(stat_aliases: Mapping[str, str]) -> dict[str, list[str]]:
    """{ODML statistic path: [PTQ paths it serves]} for the statistics whose PTQ names are not
    just their own path (what the calibrator service stores beside a calibration)."""
    out: dict[str, list[str]] = {}
    for ptq_path, path in sorted(stat_aliases.items()):
        out.setdefault(path, []).append(ptq_path)
    return {p: names for p, names in out.items() if names != [p]}


def legacy_names(name: str, op_id: str | None, side: str | None) -> Iterable[str]:
    """Names the statistic ``name`` had in qmill's earlier calibrations (model_output[_<i>],
    dot_general<n>_<side> for a jnp.dot), which the conversion provider still reads."""
    if op_id is not None and side is not None and ptq_id(op_id) != op_id:
        yield f"{ptq_id(op_id)}_{side}"
    if op_id is None and name.startswith("final_output"):
        index = int(name.removeprefix("final_output"))
        yield "model_output" if index == 0 else f"model_output_{index}"
        yield f"model_output_{index}"
