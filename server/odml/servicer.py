"""The OdmlExporter service: model + uploaded params + rules (+ a calibration) -> .tflite stream.

A thin adapter: it resolves the names in the request through ``Backends`` (the model registry,
the upload store and the calibration store), runs ``export.export_tflite`` on the engine
executor (never on the event loop), and streams OdmlModelInfo then the bytes in chunks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc
from qmill.server import auth, calls, codec, errors, params

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Backends:
    """Where the names of a request are looked up (tenant first: ids are per tenant)."""

    # ModelSpec -> an unbound Flax Linen module; ValueError for a bad config, LookupError unknown.
    resolve_model: Callable[[pb.ModelSpec], Any]
    # (tenant, upload id) -> the model's float params as a pure dict; LookupError when unknown.
    load_params: Callable[[str, str], Any]
    # (tenant, calibration id) -> quant_stats (pure dict); LookupError when unknown.
    load_stats: Callable[[str, str], Any]
    # (tenant, upload id) -> the upload's tensors, unread (a program upload is size-checked
    # before it is read); None: programs only inline.
    upload_tensors: Callable[[str, str], Sequence[Any]] | None = None


def _lookup(fn: Callable[..., Any], *args: Any, what: str) -> Any:
    try:
        return fn(*args)
    except errors.ServerError:
        raise  # the server's own stores and registry say what is missing themselves
    except LookupError as exc:
        raise errors.NotFound(f"{what} not found: {exc}") from exc


class OdmlExporterServicer(pb_grpc.OdmlExporterServicer):
    def __init__(
        self,
        executor: futures.Executor,
        backends: Backends | None,
        *,
        # None: programs.DEFAULT_MAX_BYTES (engine/programs/program.py).
        max_program_bytes: int | None = None,
    ) -> None:
        self._executor = executor
        self._max_program_bytes = max_program_bytes
        # None: this server has no model registry / stores wired in (answered FAILED_PRECONDITION).
        self._backends = backends

    def _export_program(self, request: pb.ExportOdmlRequest, tenant: str) -> tuple[bytes, Any]:
        from qmill.engine.programs import program as programs
        from qmill.server.calibrator import program_session
        from qmill.server.odml import export

        if request.model.name or request.params_upload_id or request.rules:
            raise ValueError(
                "send either a program or a model with params and rules, not both: the "
                "program carries its weights, scales and input shapes"
            )
        upload_tensors = self._backends and self._backends.upload_tensors
        if request.program_upload_id and not request.program and upload_tensors is None:
            raise errors.FailedPrecondition("this server has no upload store configured")

        def tensors(tenant: str, upload_id: str) -> Sequence[Any]:
            return _lookup(upload_tensors, tenant, upload_id, what="upload")

        max_bytes = self._max_program_bytes
        if max_bytes is None:
            max_bytes = programs.DEFAULT_MAX_BYTES
        data = program_session.program_bytes(
            request.program, request.program_upload_id, tensors, tenant, max_bytes
        )
        # Export programs are lowered for cpu whatever this server runs on: the converter reads
        # the cpu lowering, it does not run it.
        program = programs.load(data, max_bytes=max_bytes)
        try:
            return export.export_program(program)
        except export.OdmlUnavailable as exc:
            raise errors.Unimplemented(str(exc)) from exc

    def _export(self, request: pb.ExportOdmlRequest, tenant: str) -> tuple[bytes, Any]:
        from qmill.engine.providers import odml
        from qmill.server.odml import export

        if request.program or request.program_upload_id:
            return self._export_program(request, tenant)
        if self._backends is None:
            raise errors.FailedPrecondition(
                "this server has no model registry or upload store configured for ExportOdml"
            )
        rules = codec.rules_from_proto(request.rules)
        if not rules:
            raise ValueError("ExportOdml needs at least one rule (e.g. weight_qtype: int8)")
        spec = codec.input_spec(request.input_shape, request.input_dtype)
        static = any(r.resolved_act_static_scale for r in rules)
        if static and not request.calibration_id:
            raise errors.FailedPrecondition(
                "static-range rules (act_static_scale) need a calibration_id: run Calibrate "
                "with the same rules first"
            )
        b = self._backends
        module = _lookup(b.resolve_model, request.model, what=f"model {request.model.name!r}")
        if not request.params_upload_id:
            raise ValueError("params_upload_id is empty: upload the model's params first")
        tree = _lookup(b.load_params, tenant, request.params_upload_id, what="params upload")
        stats = None
        if request.calibration_id:
            stats = _lookup(b.load_stats, tenant, request.calibration_id, what="calibration")
        try:
            return export.export_tflite(module, params.unwrap(tree), rules, stats, spec)
        except export.OdmlUnavailable as exc:
            raise errors.Unimplemented(str(exc)) from exc
        except odml.LiteRtUnsupported as exc:
            raise errors.FailedPrecondition(str(exc)) from exc

    @errors.streaming
    async def ExportOdml(self, request, context):
        # The export route (the engine's providers, Flax: ~10-18 MB) is imported on the first
        # export, not when the server starts: most servers only quantize (issue 27).
        from qmill.server.odml import export

        available, reason = export.availability()
        if not available:
            raise errors.Unimplemented(reason)
        tenant = auth.current_principal().tenant
        loop = asyncio.get_running_loop()
        tflite, info = await loop.run_in_executor(self._executor, self._export, request, tenant)
        yield pb.ExportOdmlResponse(info=codec.odml_info(tflite, info.ops, info.quantized_weights))
        for chunk in codec.byte_chunks(tflite):
            yield pb.ExportOdmlResponse(chunk=chunk)
        calls.annotate(tflite_bytes=len(tflite), model=request.model.name or "program")
