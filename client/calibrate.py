"""Client side of Calibrate: stream batches, collect the merged stats (and PTQ params)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence

import grpc
import numpy as np

from qmill.client import errors
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc


@dataclasses.dataclass(kw_only=True)
class CalibrateResult:
    # The merged quant_stats leaves by '/'-joined path.
    stats: dict[str, np.ndarray]
    # PTQ params when asked: path -> {"qvalue", "scale"[, "zero_point"]} or {"value"} (float).
    params: dict[str, dict[str, np.ndarray]]
    # How each quantized param was made.
    results: dict[str, pb.TensorResult]
    summary: pb.CalibrateSummary


def _requests(start: pb.CalibrateStart, batches: Iterable[np.ndarray]) -> Iterator:
    yield pb.CalibrateRequest(start=start)
    for i, batch in enumerate(batches):
        array = np.ascontiguousarray(batch)
        data = wire.to_bytes(array)
        yield pb.CalibrateRequest(batch=wire.header_for(f"batch_{i}", array, data))
        for chunk in wire.chunks(data):
            yield pb.CalibrateRequest(chunk=chunk)


def calibrate(
    channel: grpc.Channel,
    start: pb.CalibrateStart,
    batches: Iterable[np.ndarray],
    *,
    metadata: Sequence[tuple[str, str]] | None = None,
    timeout: float | None = None,
) -> CalibrateResult:
    """Runs one Calibrate call; every tensor of ``batches`` is one batch of the model input."""
    stub = pb_grpc.CalibratorStub(channel)
    stats: dict[str, np.ndarray] = {}
    params: dict[str, dict[str, np.ndarray]] = {}
    results: dict[str, pb.TensorResult] = {}
    pending: list[tuple[dict, str, wire.Assembler]] = []
    summary = None
    try:
        for response in stub.Calibrate(
            _requests(start, batches), metadata=metadata, timeout=timeout
        ):
            kind = response.WhichOneof("item")
            if kind == "stat":
                pending.append((stats, response.stat.path, wire.Assembler(response.stat)))
            elif kind == "param":
                results[response.param.path] = response.param
                target = params.setdefault(response.param.path, {})
                pending.extend((target, h.path, wire.Assembler(h)) for h in response.param.parts)
            elif kind == "chunk":
                if not pending:
                    raise errors.QmillError("DATA_LOSS", "a chunk arrived for no tensor")
                pending[0][2].add(response.chunk)
            elif kind == "summary":
                summary = response.summary
            # Zero-length tensors have no chunks: settle every finished one in order.
            while pending and pending[0][2].complete:
                target, key, assembler = pending.pop(0)
                target[key] = np.array(assembler.finish())
    except grpc.RpcError as exc:
        raise errors.QmillError.from_rpc_error(exc) from exc
    except wire.WireError as exc:
        raise errors.QmillError("DATA_LOSS", str(exc)) from exc
    if summary is None or pending:
        raise errors.QmillError("DATA_LOSS", "the Calibrate stream ended early")
    return CalibrateResult(stats=stats, params=params, results=results, summary=summary)
