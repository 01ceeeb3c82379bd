"""A user's model from a Python entry point ``module:function``, made into programs on the client.

``path/to/file.py:function`` loads the file directly.

The function (no arguments) returns a mapping with:

  model    a Flax Linen module (unbound) or an NNX module (holding its params)
  inputs   one example batch per model input (a tuple of arrays; any batch size)
  params   optional, Linen: the float params (a pure dict); else `--params` or a fresh init

The model's code runs here, on the client, and nowhere else: the server gets a serialized
jax.export program (qmill.engine.programs.program), never the code. The engine and jax are
imported on use, so `import qmill.client` stays free of jax. Rules arrive as dicts of ModelRule
fields.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import pathlib
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# The artifact layout of qmill.engine.programs.program (read here without jax).
_MAGIC = b"QMILLPRG\x01\n"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelFn:
    model: Any
    inputs: tuple[np.ndarray, ...]
    params: Any = None


def _module(name: str) -> Any:
    if name.endswith(".py"):
        path = pathlib.Path(name)
        spec = importlib.util.spec_from_file_location(f"_qmill_model_fn_{path.stem}", path)
        if spec is None or spec.loader is None or not path.is_file():
            raise ImportError(f"no such file {name}")
        module = importlib.util.module_from_spec(spec)
        # Registered before it runs, as an import would be: dataclasses (a Linen module with a
        # field) look their module up in sys.modules while the class is being made.
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[spec.name]
            raise
        return module
    if "" not in sys.path:
        sys.path.insert(0, "")  # as `python -m` does: the user's own modules beside them
    return importlib.import_module(name)


def load(spec: str) -> ModelFn:
    """Imports ``module:function`` (or ``path/to/file.py:function``) and calls the function."""
    module_name, sep, function = spec.rpartition(":")
    if not sep or not module_name or not function:
        raise ValueError(f"--model-fn {spec!r}: give module:function, e.g. my_models:build")
    try:
        fn = getattr(_module(module_name), function)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--model-fn {spec!r}: {exc}") from None
    built = fn()
    if not isinstance(built, Mapping) or not {"model", "inputs"} <= set(built):
        raise ValueError(f"--model-fn {spec!r} must return a mapping with 'model' and 'inputs'")
    inputs = built["inputs"]
    inputs = tuple(inputs) if isinstance(inputs, tuple | list) else (inputs,)
    return ModelFn(
        model=built["model"],
        inputs=tuple(np.asarray(x) for x in inputs),
        params=built.get("params"),
    )


def read_header(data: bytes) -> dict[str, Any]:
    """The JSON header of a program artifact (kind, input shapes), without jax."""
    if not data.startswith(_MAGIC) or len(data) < len(_MAGIC) + 4:
        raise ValueError("not a qmill program: make one with `qmill export-program`")
    (n,) = struct.unpack_from("<I", data, len(_MAGIC))
    start = len(_MAGIC) + 4
    try:
        return json.loads(data[start : start + n])
    except ValueError as exc:
        raise ValueError(f"the program's header is malformed ({exc})") from None


def _rules(rules: Sequence[Mapping[str, Any]]) -> list[Any]:
    from qmill.engine.modeling import rules as rules_lib

    return [
        rules_lib.QuantizationRule(
            module_path=r.get("module_path") or ".*",
            op_names=tuple(r.get("op_names") or ()),
            weight_qtype=r.get("weight_qtype") or None,
            act_qtype=r.get("act_qtype") or None,
            tile_size=r.get("tile_size") or None,
            weight_calibration_method=r.get("weight_calibration_method") or "absmax",
            act_calibration_method=r.get("act_calibration_method") or None,
            act_static_scale=r.get("act_static_scale") or None,
            act_batch_axes=tuple(r.get("act_batch_axes") or ()) or (0,),
        )
        for r in rules
    ]


def _batched(inputs: Sequence[np.ndarray], batch_size: int) -> list[np.ndarray]:
    """The example inputs resized to `batch_size` along axis 0 (repeated when too few)."""
    return [np.resize(x, (batch_size, *x.shape[1:])).astype(x.dtype) for x in inputs]


def _nested(flat: Mapping[str, np.ndarray] | None) -> Any:
    if flat is None:
        return None
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def calibration_program(
    fn: ModelFn,
    rules: Sequence[Mapping[str, Any]],
    batch_size: int,
    params: Mapping[str, np.ndarray] | None = None,
    method: str = "static",
) -> tuple[bytes, dict[str, np.ndarray]]:
    """(calibrate artifact taking batches of `batch_size`, {path: float param}); `method`:
    static ranges, or the statistics of a calibrated method (gptq, awq, smoothquant)."""
    from qmill.engine.programs import build as program_build

    tree = _nested(params) if params is not None else fn.params
    data, flat = program_build.calibration_program(
        fn.model, _rules(rules), *_batched(fn.inputs, batch_size), params=tree, method=method
    )
    return data, {k: np.asarray(v) for k, v in flat.items()}


def export_program(
    fn: ModelFn,
    rules: Sequence[Mapping[str, Any]],
    params: Mapping[str, np.ndarray] | None = None,
    stats: Mapping[str, np.ndarray] | None = None,
) -> bytes:
    """An export artifact for one example at a time (batch 1), with the calibration's stats."""
    from qmill.engine.programs import build as program_build

    tree = _nested(params) if params is not None else fn.params
    return program_build.export_program(
        fn.model,
        _rules(rules),
        *_batched(fn.inputs, 1),
        params=tree,
        quant_stats=_nested(stats),
    )


def run_calibration(
    program: bytes, params: Mapping[str, np.ndarray], batches: Any
) -> tuple[dict[str, np.ndarray], int, int]:
    """Runs a calibrate artifact in this process, as a server's Calibrate does: (merged
    statistics by '/'-joined path, batches, examples). `batches` yields one array per model
    input (a tuple when there are several)."""
    import jax

    from qmill.engine.programs import program as programs

    prog = programs.load(program, platform=jax.devices()[0].platform)
    tree = programs.tree_from_flat(prog.params, dict(params), "params")
    step, stats = programs.calibrate_step(prog), programs.zero_stats(prog)
    batch_count = examples = 0
    for batch in batches:
        xs = programs.check_inputs(prog, list(batch) if isinstance(batch, tuple) else [batch])
        stats = step(tree, stats, *xs)
        batch_count, examples = batch_count + 1, examples + int(xs[0].shape[0])
    flat = {p: np.asarray(v) for p, v in programs.flat_paths(stats).items()}
    return flat, batch_count, examples
