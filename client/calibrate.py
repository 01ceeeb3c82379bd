"""Client side of Calibrate: stream batches, collect the merged stats (and PTQ params).

The `qmill calibrate` command is qmill.cli.calibrate's.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import pathlib
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)

import numpy as np

from qmill import checkpoints
from qmill.client import errors
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb


@dataclasses.dataclass(kw_only=True)
class CalibrateResult:
    # The merged quant_stats leaves by '/'-joined path.
    stats: dict[str, np.ndarray]
    # PTQ params when asked: path -> {"qvalue", "scale"[, "zero_point"]} or {"value"} (float).
    params: dict[str, dict[str, np.ndarray]]
    # How each quantized param was made.
    results: dict[str, pb.TensorResult]
    summary: pb.CalibrateSummary


def requests(
    start: pb.CalibrateStart, batches: Iterable[np.ndarray | Sequence[np.ndarray]]
) -> Iterator[pb.CalibrateRequest]:
    """The start message, then each batch (header and chunks). A program's batch is a tuple
    of arrays, one per model input, sent one after the other."""
    yield pb.CalibrateRequest(start=start)
    for i, batch in enumerate(batches):
        arrays = batch if isinstance(batch, tuple | list) else (batch,)
        for j, array in enumerate(arrays):
            path = f"batch_{i}" if len(arrays) == 1 else f"batch_{i}/input_{j}"
            yield from wire.send(pb.CalibrateRequest, "batch", path, np.ascontiguousarray(array))


def static_ranges(
    calibration_id: str = "",
    stats: Mapping[str, np.ndarray] | None = None,
    act_qtypes: Mapping[str, str] | None = None,
) -> pb.StaticRanges:
    """QuantizeParams' static ranges: a calibration id, or merged statistics (Calibrate's
    `stats`, '/'-joined leaf paths) with the act qtype of each statistic."""
    inline = []
    for path, array in (stats or {}).items():
        data = wire.to_bytes(np.ascontiguousarray(array))
        header = wire.header_for(path, array, data)
        inline.append(pb.InlineTensor(header=header, data=data.tobytes()))
    return pb.StaticRanges(
        calibration_id=calibration_id, quant_stats=inline, act_qtypes=dict(act_qtypes or {})
    )


def with_static_ranges(
    requests: Iterable[pb.QuantizeParamsRequest], ranges: pb.StaticRanges | None
) -> Iterator[pb.QuantizeParamsRequest]:
    """QuantizeParams requests with `ranges` right after the recipe (none: unchanged)."""
    for i, request in enumerate(requests):
        yield request
        if i == 0 and ranges is not None:
            yield pb.QuantizeParamsRequest(static_ranges=ranges)


async def async_with_static_ranges(
    requests: AsyncIterable[pb.QuantizeParamsRequest], ranges: pb.StaticRanges | None
) -> AsyncIterator[pb.QuantizeParamsRequest]:
    """As with_static_ranges, for an async request stream."""
    first = True
    async for request in requests:
        yield request
        if first and ranges is not None:
            yield pb.QuantizeParamsRequest(static_ranges=ranges)
        first = False


def _check_param(param: pb.TensorResult) -> None:
    """A PTQ param is QUANTIZED (qvalue, scale[, zero_point]) or FLOAT (one part, "value"): the
    client has no copy of the server's params, so a KEPT one (no bytes) could not be written."""
    names = {h.path for h in param.parts}
    if param.kind == pb.RESULT_KIND_FLOAT:
        ok = names == {"value"}
    elif param.kind == pb.RESULT_KIND_QUANTIZED:
        ok = {"qvalue", "scale"} <= names <= {"qvalue", "scale", "zero_point"}
    else:
        ok = False
    if not ok:
        kind = (
            pb.ResultKind.Name(param.kind) if param.kind in pb.ResultKind.values() else param.kind
        )
        raise errors.QmillError(
            "DATA_LOSS",
            f"PTQ param {param.path} came as {kind} with parts {sorted(names)}; expected "
            "RESULT_KIND_QUANTIZED (qvalue, scale[, zero_point]) or RESULT_KIND_FLOAT (value)",
        )


class Collector:
    """Feeds on Calibrate responses; `result()` once the stream has ended.

    ``on_progress`` sees the running totals (over the whole calibration) after each batch.
    """

    def __init__(self, on_progress: Callable[[pb.CalibrateProgress], None] | None = None) -> None:
        self._on_progress = on_progress
        self._receiver = wire.Receiver()
        # Where each announced tensor goes, in announcement order: (mapping, key).
        self._targets: collections.deque[tuple[dict[str, np.ndarray], str]] = collections.deque()
        self._stats: dict[str, np.ndarray] = {}
        self._params: dict[str, dict[str, np.ndarray]] = {}
        self._results: dict[str, pb.TensorResult] = {}
        self._summary: pb.CalibrateSummary | None = None

    def feed(self, response: pb.CalibrateResponse) -> None:
        kind = response.WhichOneof("item")
        if kind == "progress" and self._on_progress is not None:
            self._on_progress(response.progress)
        elif kind == "stat":
            self._targets.append((self._stats, response.stat.path))
            self._receiver.announce(response.stat)
        elif kind == "param":
            param = response.param
            _check_param(param)
            self._results[param.path] = param
            target = self._params.setdefault(param.path, {})
            self._targets.extend((target, h.path) for h in param.parts)
            self._receiver.announce(*param.parts)
        elif kind == "chunk":
            self._receiver.add(response.chunk)
        elif kind == "summary":
            self._summary = response.summary
        for _, array in self._receiver.take():
            target, key = self._targets.popleft()
            target[key] = array

    def result(self) -> CalibrateResult:
        if self._summary is None or self._receiver.receiving:
            raise errors.QmillError("DATA_LOSS", "the Calibrate stream ended early")
        return CalibrateResult(
            stats=self._stats, params=self._params, results=self._results, summary=self._summary
        )


# ------------------------------------------------------------------------------- inputs/outputs


def load_batches(path: str | os.PathLike[str], batch_size: int) -> Iterator[np.ndarray]:
    """Batches of ``batch_size`` examples (the last may be smaller) along axis 0 of a .npy file,
    memory-mapped so only one batch is read at a time."""
    if batch_size <= 0:
        raise ValueError(f"batch size must be positive, got {batch_size}")
    array = np.load(path, mmap_mode="r", allow_pickle=False)
    if not isinstance(array, np.ndarray) or array.ndim == 0 or len(array) == 0:
        raise ValueError(f"{path}: expected a .npy array of examples along axis 0")
    for start in range(0, len(array), batch_size):
        yield np.ascontiguousarray(array[start : start + batch_size])


def write_ptq(result: CalibrateResult, destination: str, *, overwrite: bool = False) -> int:
    """Writes the PTQ params as a checkpoint (.safetensors / .npz by suffix, else an Orbax
    directory) in the Qwix PTQ layout (P/array/qvalue, P/array/scale); returns the tensor count."""
    if not result.params:
        raise ValueError("the server sent no PTQ params (ask for them with return_ptq_params)")
    suffix = pathlib.Path(destination).suffix
    fmt = {".safetensors": "safetensors", ".npz": "npz"}.get(suffix, "orbax")
    with checkpoints.create_writer(destination, fmt, overwrite=overwrite) as writer:
        for path, parts in result.params.items():
            if "value" in parts:
                writer.write(path, parts["value"])
            else:
                writer.write_quantized(path, parts)
        writer.commit()
    return len(result.params)
