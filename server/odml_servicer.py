"""The OdmlExporter service: model + uploaded params + rules (+ a calibration) -> .tflite stream.

A thin adapter: it resolves the names in the request through ``Backends`` (the model registry,
the upload store and the calibration store), runs ``odml_export.export_tflite`` on the engine
executor (never on the event loop), and streams OdmlModelInfo then the bytes in chunks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from concurrent import futures
from typing import Any

import jax

from qmill.engine import qtypes
from qmill.engine import rules as rules_lib
from qmill.engine.providers import odml
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc
from qmill.server import auth, calls, errors, odml_export

log = logging.getLogger(__name__)

CHUNK_BYTES = 4 * 1024 * 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class Backends:
    """Where the names of a request are looked up (tenant first: ids are per tenant)."""

    # ModelSpec -> an unbound Flax Linen module; ValueError for a bad config, LookupError unknown.
    resolve_model: Callable[[pb.ModelSpec], Any]
    # (tenant, upload id) -> the model's float params as a pure dict; LookupError when unknown.
    load_params: Callable[[str, str], Any]
    # (tenant, calibration id) -> quant_stats (pure dict); LookupError when unknown.
    load_stats: Callable[[str, str], Any]


def rules_from_proto(rules: Any) -> list[rules_lib.QuantizationRule]:
    """ModelRule messages -> engine rules (ValueError with the rule's index when one is bad)."""
    out = []
    for i, r in enumerate(rules):
        try:
            for qtype in (r.weight_qtype, r.act_qtype):
                if qtype:
                    qtypes.name(qtype)
            out.append(
                rules_lib.QuantizationRule(
                    module_path=r.module_path or ".*",
                    op_names=tuple(r.op_names),
                    weight_qtype=r.weight_qtype or None,
                    act_qtype=r.act_qtype or None,
                    tile_size=r.tile_size or None,
                    weight_calibration_method=r.weight_calibration_method or "absmax",
                    act_calibration_method=r.act_calibration_method or None,
                    act_static_scale=r.act_static_scale or None,
                )
            )
        except (ValueError, TypeError) as exc:
            raise ValueError(f"rules[{i}]: {exc}") from exc
    if not out:
        raise ValueError("ExportOdml needs at least one rule (e.g. weight_qtype: int8)")
    return out


def _input_spec(request: pb.ExportOdmlRequest) -> jax.ShapeDtypeStruct:
    shape = tuple(int(d) for d in request.input_shape)
    if not shape or any(d <= 0 for d in shape):
        raise ValueError(f"input_shape must be positive dimensions, batch first; got {list(shape)}")
    dtype = wire.to_numpy_dtype(request.input_dtype or pb.DTYPE_F32)
    return jax.ShapeDtypeStruct(shape, dtype)


def _lookup(fn: Callable[..., Any], *args: Any, what: str) -> Any:
    try:
        return fn(*args)
    except LookupError as exc:
        raise wire.WireError(f"{what} not found: {exc}", "NOT_FOUND") from exc


class OdmlExporterServicer(pb_grpc.OdmlExporterServicer):
    def __init__(self, executor: futures.Executor, backends: Backends | None) -> None:
        self._executor = executor
        # None: this server has no model registry / stores wired in (answered FAILED_PRECONDITION).
        self._backends = backends

    def _export(self, request: pb.ExportOdmlRequest, tenant: str) -> tuple[bytes, Any]:
        if self._backends is None:
            raise wire.WireError(
                "this server has no model registry or upload store configured for ExportOdml",
                "FAILED_PRECONDITION",
            )
        rules = rules_from_proto(request.rules)
        spec = _input_spec(request)
        static = any(r.resolved_act_static_scale for r in rules)
        if static and not request.calibration_id:
            raise wire.WireError(
                "static-range rules (act_static_scale) need a calibration_id: run Calibrate "
                "with the same rules first",
                "FAILED_PRECONDITION",
            )
        b = self._backends
        module = _lookup(b.resolve_model, request.model, what=f"model {request.model.name!r}")
        if not request.params_upload_id:
            raise ValueError("params_upload_id is empty: upload the model's params first")
        params = _lookup(b.load_params, tenant, request.params_upload_id, what="params upload")
        params = odml_export.unwrap_params(params)
        stats = None
        if request.calibration_id:
            stats = _lookup(b.load_stats, tenant, request.calibration_id, what="calibration")
        try:
            return odml_export.export_tflite(module, params, rules, stats, spec)
        except odml_export.OdmlUnavailable as exc:
            raise wire.WireError(str(exc), "UNIMPLEMENTED") from exc
        except odml.LiteRtUnsupported as exc:
            raise wire.WireError(str(exc), "FAILED_PRECONDITION") from exc

    @errors.streaming
    async def ExportOdml(self, request, context):
        available, reason = odml_export.availability()
        if not available:
            raise wire.WireError(reason, "UNIMPLEMENTED")
        tenant = auth.current_principal().tenant
        loop = asyncio.get_running_loop()
        tflite, info = await loop.run_in_executor(self._executor, self._export, request, tenant)
        yield pb.ExportOdmlResponse(
            info=pb.OdmlModelInfo(
                byte_length=len(tflite),
                crc32c=wire.crc32c(tflite),
                ops=list(info.ops),
                quantized_weights=dict(info.quantized_weights),
            )
        )
        for offset in range(0, len(tflite), CHUNK_BYTES):
            yield pb.ExportOdmlResponse(chunk=_chunk(tflite, offset))
        calls.annotate(tflite_bytes=len(tflite), model=request.model.name)


def _chunk(data: bytes, offset: int) -> pb.TensorChunk:
    return pb.TensorChunk(offset=offset, data=data[offset : offset + CHUNK_BYTES])
