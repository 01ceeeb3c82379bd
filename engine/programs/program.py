"""Models that travel as programs: a user's model as a serialized ``jax.export`` artifact.

The client, where the model's code and jax already are, traces the model under a provider
(engine/program_build.py) and serializes the result (StableHLO plus its signature); the server
deserializes, checks and runs it on its own device, and never imports or unpickles user code.
Two kinds:

  calibrate  ``f(params, quant_stats, *inputs) -> quant_stats``: the model under the QT provider
             (OdmlQatProvider when every rule is one LiteRT stores, so the model output gets a
             statistic too), static-range statistics in and updated out. Params are an argument,
             so one program serves any params of the model; the server adds batch after batch
             exactly as a local QT run does (averaging.update inside the program).
  export     ``f(*inputs) -> outputs``: the model under OdmlConversionProvider, every quantization
             point a ``quant.fake_quant`` composite. Its weights are constants: the provider needs
             them concrete to compute qmill's scales, and the LiteRT converter needs them as
             constants to store them quantized. Single platform ``cpu`` (a multi-platform export
             adds a platform-index argument the converter would take for an input).

An artifact is ``MAGIC``, a 4-byte little-endian header length, a JSON header (format, kind, the
act qtype of each statistic, the input shapes) and the ``jax.export`` serialization. Paths are
'/'-joined tree keys.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.contrib import leaf as contrib_leaf
from qmill.engine.core import averaging, qarray
from qmill.engine.modeling import rules as rules_lib
from qmill.engine.providers import odml_boundary

MAGIC = b"QMILLPRG\x01\n"
FORMAT = "qmill.program/1"
CALIBRATE, EXPORT = "calibrate", "export"
# Calibration programs run where the server runs: build them for both, the server picks its own.
CALIBRATE_PLATFORMS = ("cpu", "cuda")
# Servers refuse larger artifacts unless configured otherwise (weights of export programs count).
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
_OP_ID = re.compile(r"(?P<op>.+?)\d+_(lhs|rhs)")
_CUSTOM_CALL = re.compile(r"custom_call\s*@([\w.$-]+)|call_target_name\s*=\s*\"([^\"]*)\"")


class ProgramError(ValueError):
    """An artifact or its arguments are not what the program takes; the message says the fix."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Program:
    """A deserialized, checked artifact."""

    kind: str
    exported: jax.export.Exported
    # calibrate: statistic path ('/'-joined, e.g. "Dense_0/dot_general0_lhs") -> the act qtype
    # its static scale is computed for.
    stat_qtypes: Mapping[str, str]
    # calibrate: statistic path -> the PTQ statistic paths it serves, where they are not just its
    # own (an ODML calibration: jnp.dot's "dot0_lhs" serves "dot_general0_lhs", a sibling op's
    # shared statistic serves the sibling too; providers/odml_names.py). Absent: its own path.
    stat_aliases: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)
    # Hex SHA-256 of the whole artifact: names the model + rules a calibration belongs to.
    sha256: str

    def _args(self) -> tuple[Any, ...]:
        args, _ = jax.tree.unflatten(self.exported.in_tree, self.exported.in_avals)
        return args

    @property
    def params(self) -> Any:
        """calibrate: the params argument as a tree of ShapedArrays."""
        return self._args()[0] if self.kind == CALIBRATE else {}

    @property
    def stats(self) -> Any:
        """calibrate: the quant_stats argument as a tree of ShapedArrays."""
        return self._args()[1] if self.kind == CALIBRATE else {}

    @property
    def inputs(self) -> tuple[Any, ...]:
        """The model inputs (ShapedArrays, batch axis first)."""
        return tuple(self._args()[2:] if self.kind == CALIBRATE else self._args())


def path_of(keys: Sequence[Any]) -> str:
    """'/'-joined names of a jax key path (dict keys, sequence indices, attributes)."""
    names = []
    for k in keys:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                names.append(str(getattr(k, attr)))
                break
        else:
            names.append(str(k))
    return "/".join(names)


def flat_paths(tree: Any) -> dict[str, Any]:
    """{path: leaf} of a pytree, in its flattening order."""
    return {path_of(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


# ---------------------------------------------------------------------------- serialization


def serialize(
    kind: str,
    exported: jax.export.Exported,
    stat_qtypes: Mapping[str, str],
    stat_aliases: Mapping[str, Sequence[str]] | None = None,
) -> bytes:
    args, _ = jax.tree.unflatten(exported.in_tree, exported.in_avals)
    inputs = args[2:] if kind == CALIBRATE else args
    header = json.dumps(
        {
            "format": FORMAT,
            "kind": kind,
            "stat_qtypes": dict(stat_qtypes),
            "stat_aliases": {k: list(v) for k, v in (stat_aliases or {}).items()},
            # For clients without jax (qmill.checkpoints.model_fn.read_header): batch shapes.
            "inputs": [[list(a.shape), np.dtype(a.dtype).name] for a in inputs],
        }
    )
    raw = header.encode()
    return MAGIC + struct.pack("<I", len(raw)) + raw + bytes(exported.serialize())


def _platform_name(platform: str) -> str:
    return {"gpu": "cuda"}.get(platform, platform)


def load(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES, platform: str = "cpu") -> Program:
    """Deserializes and checks an artifact for a device of ``platform`` ("cpu", "cuda", ...).

    Raises:
      ProgramError: over ``max_bytes``, not a qmill program, or not built for ``platform``.
    """
    if len(data) > max_bytes:
        raise ProgramError(
            f"the program has {len(data):,} bytes, over this server's limit of {max_bytes:,}; "
            "export a smaller model or raise the server's limit"
        )
    rebuild = "rebuild it with `qmill export-program` (or qmill.engine.programs.program)"
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise ProgramError(f"not a qmill program (wrong magic bytes); {rebuild}")
    (n,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(data[start : start + n])
        kind, stat_qtypes = header["kind"], dict(header["stat_qtypes"])
        # Programs built before issue 40 have no aliases: every statistic serves its own path.
        stat_aliases = {k: tuple(v) for k, v in header.get("stat_aliases", {}).items()}
        if header.get("format") != FORMAT or kind not in (CALIBRATE, EXPORT):
            raise ValueError(f"format {header.get('format')!r}, kind {kind!r}")
        exported = jax.export.deserialize(bytearray(data[start + n :]))
    except Exception as exc:  # any parse failure is the artifact's fault
        msg = f"the program is malformed ({type(exc).__name__}: {exc}); {rebuild}"
        raise ProgramError(msg) from None
    want = _platform_name(platform)
    if want not in exported.platforms:
        raise ProgramError(
            f"the program was built for {list(exported.platforms)}; this server runs on {want}: "
            f"{rebuild} with platforms including {want!r}"
        )
    if kind == EXPORT and tuple(exported.platforms) != ("cpu",):
        raise ProgramError(f"an export program is built for platform 'cpu' only; {rebuild}")
    if exported.nr_devices != 1:
        raise ProgramError(f"the program is sharded over {exported.nr_devices} devices; {rebuild}")
    # A custom call runs whatever C function the server's XLA has registered under that name:
    # qmill's programs need none, so none is run.
    targets = sorted({a or b for a, b in _CUSTOM_CALL.findall(exported.mlir_module())})
    if targets:
        raise ProgramError(f"the program calls custom targets {targets[:5]}, which are not run")
    program = Program(
        kind=kind,
        exported=exported,
        stat_qtypes=stat_qtypes,
        stat_aliases=stat_aliases,
        sha256=hashlib.sha256(data).hexdigest(),
    )
    if kind == CALIBRATE:
        _check_calibrate_signature(program)
    return program


def _check_calibrate_signature(program: Program) -> None:
    exp = program.exported
    args, kwargs = jax.tree.unflatten(exp.in_tree, exp.in_avals)
    if kwargs or len(args) < 3:
        raise ProgramError("a calibrate program takes (params, quant_stats, *inputs)")
    out = jax.tree.unflatten(exp.out_tree, exp.out_avals)
    if jax.tree.structure(out) != jax.tree.structure(args[1]):
        raise ProgramError("a calibrate program returns quant_stats shaped as it takes them")
    stats = {p.rsplit("/", 1)[0] for p in flat_paths(args[1])}
    # The header names the act qtype of every static-range statistic (a method's have none).
    static = {s for s in stats if contrib_leaf.method_of(s) is None}
    if not stats or set(program.stat_qtypes) != static:
        raise ProgramError("the program's header does not name its statistics; rebuild it")


# -------------------------------------------------------------------------- running (server)


def tree_from_flat(avals: Any, flat: Mapping[str, Any], what: str) -> Any:
    """The tree of ``avals`` with leaves from ``flat`` {path: array}, checked leaf by leaf.

    Raises:
      ProgramError: missing, extra or mis-shaped leaves (the first few named).
    """
    want = flat_paths(avals)
    missing = sorted(set(want) - set(flat))
    extra = sorted(set(flat) - set(want))
    wrong = [
        f"{p}: {list(np.shape(flat[p]))} {np.dtype(flat[p].dtype).name} vs "
        f"{list(a.shape)} {np.dtype(a.dtype).name}"
        for p, a in want.items()
        if p in flat
        and (tuple(np.shape(flat[p])) != tuple(a.shape) or np.dtype(flat[p].dtype) != a.dtype)
    ]
    if missing or extra or wrong:
        parts = [
            f"missing {missing[:5]}" if missing else "",
            f"unexpected {extra[:5]}" if extra else "",
            f"mismatched {wrong[:5]}" if wrong else "",
        ]
        raise ProgramError(f"{what} do not fit the program: " + "; ".join(p for p in parts if p))
    leaves = [flat[p] for p in want]
    return jax.tree.unflatten(jax.tree.structure(avals), leaves)


def zero_stats(program: Program) -> Any:
    """Empty statistics (averaging.init's zeros) in the program's quant_stats structure."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), program.stats)


def check_inputs(program: Program, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """One batch, one array per model input, as the program takes it.

    Raises:
      ProgramError: wrong count, shape or dtype, an empty batch, NaN or Inf (what to send instead).
    """
    specs = program.inputs
    if len(arrays) != len(specs):
        raise ProgramError(
            f"a batch is {len(specs)} tensor(s), one per model input; got {len(arrays)}"
        )
    out, batch = [], None
    for i, (x, spec) in enumerate(zip(arrays, specs, strict=True)):
        dims = [d if isinstance(d, int) else None for d in spec.shape]
        want = "[" + ", ".join("batch" if d is None else str(d) for d in dims) + "]"
        fits = x.ndim == len(dims) and all(
            d is None or d == s for d, s in zip(dims, x.shape, strict=True)
        )
        if not fits:
            raise ProgramError(f"input {i} of shape {list(x.shape)}; the program takes {want}")
        dt = np.dtype(spec.dtype)
        if x.dtype != dt:
            if x.dtype.kind != dt.kind:
                raise ProgramError(f"input {i} of dtype {x.dtype}; the program takes {dt.name}")
            x = x.astype(dt)  # same kind (float64 -> float32): a safe cast for inputs
        n = x.shape[0] if x.ndim else 1
        if n == 0 or (batch is not None and n != batch):
            raise ProgramError(f"input {i} has {n} examples; every input needs the same, ≥ 1")
        batch = n
        if x.dtype.kind == "f":
            # Statistics are sums kept across calls: one NaN would spoil the calibration for good.
            bad = np.flatnonzero(~np.isfinite(x).reshape(n, -1).all(axis=1))
            if bad.size:
                raise ProgramError(
                    f"input {i} has NaN or Inf values in {bad.size} example(s) (first: example "
                    f"{int(bad[0])}); clean or drop them"
                )
        out.append(x)
    return out


def calibrate_step(program: Program) -> Callable[..., Any]:
    """jit(params, stats, *inputs) -> stats, running the artifact on this device."""
    return jax.jit(program.exported.call)


def static_scales(
    quant_stats: Mapping[str, Any],
    stat_qtypes: Mapping[str, str],
    stat_aliases: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, np.ndarray]:
    """Static activation scales from merged statistics, keyed as a PTQ model's params:
    ``<module>/<op>_<side>_scale/array`` (and ``..._zero_point`` when asymmetric), with the
    arithmetic of providers.ptq.quantize_params; a statistic with ``stat_aliases`` gives the
    scale of each PTQ op it serves. Statistics of the model inputs / output are skipped (only a
    LiteRT export uses them)."""
    out: dict[str, np.ndarray] = {}
    aliases = stat_aliases or {}
    for path, qtype in stat_qtypes.items():
        if odml_boundary.is_boundary_stat(path.split("/")[-1]):
            continue
        stat = {k: jnp.asarray(v) for k, v in _subtree(quant_stats, path).items()}
        if int(stat["count"]) == 0:
            raise ProgramError(f"quant_stats for {path} hold no batches (count 0)")
        scale, zero_point = qarray.compute_scale_zero_point(averaging.calibration(stat), qtype)
        for ptq_path in aliases.get(path, (path,)):
            out[f"{ptq_path}_scale/array"] = np.asarray(scale)
            if zero_point is not None:
                out[f"{ptq_path}_zero_point"] = np.asarray(zero_point)
    return out


def _subtree(tree: Mapping[str, Any], path: str) -> Mapping[str, Any]:
    node: Any = tree
    for key in path.split("/"):
        if not isinstance(node, Mapping) or key not in node:
            raise ProgramError(f"quant_stats have no statistic {path}")
        node = node[key]
    return node


def stat_qtypes(stats: Any, rules: Sequence[rules_lib.QuantizationRule]) -> dict[str, str]:
    """statistic path -> the act qtype of the rule that made it (first matching rule wins).

    A calibrated method's statistics (GPTQ Hessians and kin, contrib/leaf.py) make no static
    scale and are left out."""
    out = {}
    for path in {p.rsplit("/", 1)[0] for p in flat_paths(stats)}:
        if contrib_leaf.method_of(path) is not None:
            continue
        module, _, name = path.rpartition("/")
        if odml_boundary.is_boundary_stat(name):
            rule = odml_boundary.static_rule(rules)
        else:
            m = _OP_ID.fullmatch(name)
            rule = rules_lib.find_rule(rules, module, m["op"])[1] if m else None
        if rule is None or rule.act_qtype is None:
            raise ProgramError(f"no rule with an act_qtype made the statistic {path}")
        out[path] = str(rule.act_qtype)
    return out
