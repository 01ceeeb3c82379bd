"""One Calibrate call with a program: the client's artifact run on this server's device.

The program (engine/programs.py) takes (params, quant_stats, *inputs) and returns the updated
quant_stats, so the statistics add batch after batch inside it, in the same order as a local QT
run: a continued calibration starting from the stored stats gives the same sums bit for bit. No
user code is imported; everything here is blocking JAX work, called only from the executor.
"""

from __future__ import annotations

import collections
import hashlib
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from qmill.engine.programs import program as programs
from qmill.server import errors
from qmill.server import params as params_lib
from qmill.server.calibrator import store

# Deserializing a program and compiling its step take ~1 s; clients call Calibrate again and
# again with the same artifact (one call per data shard, continuations): keep the last few.
_CACHE_SIZE = 8
_cache: collections.OrderedDict[str, tuple[programs.Program, Callable[..., Any]]] = (
    collections.OrderedDict()
)
_cache_lock = threading.Lock()


def load(data: bytes, *, max_bytes: int, platform: str) -> programs.Program:
    """programs.load, cached by the artifact's SHA-256 (with its compiled step)."""
    if len(data) > max_bytes:
        programs.load(data, max_bytes=max_bytes)  # raises, saying the limit
    key = f"{hashlib.sha256(data).hexdigest()}/{platform}"
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key][0]
    program = programs.load(data, max_bytes=max_bytes, platform=platform)
    with _cache_lock:
        _cache[key] = (program, programs.calibrate_step(program))
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
    return program


def _step(program: programs.Program) -> Callable[..., Any]:
    with _cache_lock:
        for cached, step in _cache.values():
            if cached is program:
                return step
    return programs.calibrate_step(program)


def program_bytes(
    inline: bytes,
    upload_id: str,
    tensors: Callable[[str, str], Sequence[Any]],
    tenant: str,
    max_bytes: int,
) -> bytes:
    """The artifact of a request: inline, or the uint8 tensor "program" of an upload (its size
    checked before it is read)."""
    if inline and upload_id:
        raise ValueError("send program or program_upload_id, not both")
    if not upload_id:
        return inline
    stored = {t.path: t for t in tensors(tenant, upload_id)}
    t = stored.get("program")
    if t is None or len(stored) != 1 or np.dtype(t.dtype) != np.uint8:
        raise ValueError(
            f"upload {upload_id} is not a program: upload a safetensors file with one uint8 "
            "tensor named 'program' (qmill.client.programs.upload_program does)"
        )
    if t.nbytes > max_bytes:
        raise programs.ProgramError(
            f"the program has {t.nbytes:,} bytes, over this server's limit of {max_bytes:,}"
        )
    return np.asarray(t.read()).tobytes()


def model_key(program: programs.Program) -> str:
    """What a continuation must match: the same artifact (model, rules and batch shapes)."""
    return f"program:{program.sha256}"


def _check_stats_size(program: programs.Program, limit: int | None) -> None:
    """Refuses, before any work, a program whose statistics the server would not keep."""
    need = sum(
        int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(program.stats)
    )
    if limit is not None and need > limit:
        raise errors.ResourceExhausted(
            f"this program's statistics need {need:,} bytes (a GPTQ Hessian is d_in² float32 per "
            f"weight) but this server keeps at most {limit:,} per calibration: calibrate fewer "
            "weights per program (narrower rules), or ask the operator to raise "
            "--max-calibration-stats-bytes"
        )


class ProgramSession:
    """The program, its params and the running stats of one Calibrate call."""

    def __init__(
        self,
        program: programs.Program,
        params: Mapping[str, Any],
        previous: store.Calibration | None,
        *,
        max_stats_bytes: int | None = None,
    ) -> None:
        if program.kind != programs.CALIBRATE:
            raise programs.ProgramError(
                f"Calibrate takes a calibrate program, not an {program.kind} one"
            )
        _check_stats_size(program, max_stats_bytes)
        self.program = program
        self.stat_qtypes = dict(program.stat_qtypes)
        self.stat_aliases = dict(program.stat_aliases)
        # Each batch is one tensor per model input.
        self.inputs_per_batch = len(program.inputs)
        flat = {k: np.asarray(v) for k, v in params_lib.flatten(params_lib.unwrap(params)).items()}
        try:
            tree = programs.tree_from_flat(program.params, flat, "params")
        except programs.ProgramError as exc:
            raise errors.FailedPrecondition(str(exc)) from None
        self.params = jax.device_put(tree)
        if previous is not None:
            stats = {k: np.asarray(v) for k, v in params_lib.flatten(previous.stats).items()}
            self.stats = jax.device_put(
                programs.tree_from_flat(program.stats, stats, "stored statistics")
            )
        else:
            self.stats = programs.zero_stats(program)
        self.batches = previous.batches if previous else 0
        self.examples = previous.examples if previous else 0
        self._step = _step(program)

    def add_batch(self, arrays: Sequence[np.ndarray]) -> None:
        xs = programs.check_inputs(self.program, arrays)
        self.stats = self._step(self.params, self.stats, *xs)
        self.batches += 1
        self.examples += int(xs[0].shape[0]) if xs[0].ndim else 1

    def host_stats(self) -> dict[str, Any]:
        flat = {p: np.asarray(v) for p, v in programs.flat_paths(self.stats).items()}
        return params_lib.unflatten(flat)
