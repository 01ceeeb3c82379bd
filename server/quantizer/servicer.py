"""The Quantizer service: a thin adapter from RPCs to the stream handler and capabilities."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent import futures
from typing import Any

import grpc

from qmill.proto import framing
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc
from qmill.server import auth, calls, errors, limits
from qmill.server import config as config_lib
from qmill.server import metrics as metrics_lib
from qmill.server.calibrator import language_model as lm_lib
from qmill.server.calibrator import store as calibration_store
from qmill.server.quantizer import capabilities, static_ranges, stream

log = logging.getLogger(__name__)


class QuantizerServicer(pb_grpc.QuantizerServicer):
    def __init__(
        self,
        config: config_lib.ServerConfig,
        executor: futures.Executor,
        *,
        limiter: limits.ByteLimiter | None = None,
        metrics: metrics_lib.Metrics | None = None,
        upload_tensors: stream.UploadTensors | None = None,
        calibrations: calibration_store.CalibrationStore | None = None,
        language_models: lm_lib.LmCalibrations | None = None,
    ) -> None:
        self._config = config
        # StaticRanges naming a calibration id read it here (None: only inline statistics).
        self._calibrations = calibrations
        # A language model's calibration id reads its kept results here: the server's one
        # LmCalibrations, which then sweeps none that a call reads (None: one beside
        # `calibrations`).
        if language_models is None and calibrations is not None:
            language_models = lm_lib.beside(calibrations)
        self._language_models = language_models
        # QuantizeParams naming an upload reads its tensors through this (None: UNIMPLEMENTED).
        self._upload_tensors = upload_tensors
        self._executor = executor
        # Bounds the tensor bytes all calls hold at once (None: unbounded, for unit tests).
        self._limiter = limiter
        self._metrics = metrics

    @errors.unary
    async def GetCapabilities(self, request, context) -> pb.GetCapabilitiesResponse:
        return capabilities.capabilities(self._config)

    @errors.streaming
    async def QuantizeParams(self, request_iterator, context):
        stats = stream.CallStats()
        requests, ranges = await static_ranges.split(aiter(request_iterator))
        scales, methods, extra = {}, {}, {}
        # A language model's calibration, kept from the sweep while its results are read.
        held = contextlib.ExitStack()
        if ranges is not None and lm_lib.is_language_model(ranges.calibration_id):
            # A language model calibrated layer by layer: its linears' results are kept.
            extra = {"quantize": await self._language_model(ranges.calibration_id, held)}
        elif ranges is not None:
            tenant = auth.current_principal().tenant
            loop = asyncio.get_running_loop()
            scales = await loop.run_in_executor(
                self._executor, static_ranges.scales, ranges, tenant, self._calibrations
            )
            methods = await loop.run_in_executor(
                self._executor, static_ranges.method_stats, ranges, tenant, self._calibrations
            )
        # Weights with a method's statistics (GPTQ, AWQ, SmoothQuant) are quantized by it (AWQ and
        # SmoothQuant add their per-channel scale to the result's parts), the rest as usual.
        if methods:
            # GPTQ / AWQ / SmoothQuant import Flax (~10-18 MB): only for calls that use them.
            from qmill.engine.contrib import leaf as contrib_leaf

            extra = {"quantize": contrib_leaf.quantizer(methods)}
        try:
            async for response in stream.quantize_stream(
                requests,
                self._executor,
                self._config.max_tensor_bytes,
                stats,
                limiter=self._limiter,
                metrics=self._metrics,
                upload_tensors=self._upload_tensors,
                encode_chunks=True,
                **extra,
            ):
                # Chunks come serialized already (bytes); the summary is a message.
                last = not isinstance(response, bytes) and response.WhichOneof("item") == "summary"
                if scales and last:
                    for result in static_ranges.results(scales):
                        yield result  # after the tensors, before the summary
                yield response
        finally:
            held.close()
            # Joins the call's one log line (written by the observability interceptor).
            calls.annotate(
                tensors_in=stats.tensors_received,
                quantized=stats.tensors_quantized,
                tensor_bytes_in=stats.bytes_received,
                tensor_bytes_out=stats.bytes_sent,
            )

    async def _language_model(self, calibration_id: str, held: contextlib.ExitStack) -> Any:
        """The quantize function of a language model's calibration id; `held` keeps the
        calibration from the sweep until the call closes it (its results are read lazily)."""
        if self._language_models is None:
            raise errors.NotFound(f"calibration {calibration_id!r} not found")
        held.enter_context(self._language_models.in_use(calibration_id))
        try:
            loaders = await asyncio.get_running_loop().run_in_executor(
                self._executor,
                self._language_models.results,
                auth.current_principal().tenant,
                calibration_id,
            )
        except BaseException:
            held.close()
            raise
        return lm_lib.quantizer(loaders)


def add_to_server(servicer: QuantizerServicer, server: grpc.aio.Server) -> None:
    """Registers the Quantizer service as pb_grpc.add_QuantizerServicer_to_server does, but
    QuantizeParams' chunk requests are decoded without protobuf (framing.chunk_decoder): their 4 MiB
    of data reach the assembler as a view of grpc's bytes, not two copies; its result chunks go
    out as the bytes framing.encoded_chunks made (framing.serialized passes them through)."""
    handlers = {
        "QuantizeParams": grpc.stream_stream_rpc_method_handler(
            servicer.QuantizeParams,
            request_deserializer=framing.chunk_decoder(pb.QuantizeParamsRequest),
            # Result chunks come serialized (stream.quantize_stream's encode_chunks).
            response_serializer=framing.serialized,
        ),
        "GetCapabilities": grpc.unary_unary_rpc_method_handler(
            servicer.GetCapabilities,
            request_deserializer=pb.GetCapabilitiesRequest.FromString,
            response_serializer=pb.GetCapabilitiesResponse.SerializeToString,
        ),
    }
    service = pb.DESCRIPTOR.services_by_name["Quantizer"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
