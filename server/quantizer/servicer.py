"""The Quantizer service: a thin adapter from RPCs to the stream handler and capabilities."""

from __future__ import annotations

import logging
from concurrent import futures

from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc
from qmill.server import calls, errors, limits
from qmill.server import config as config_lib
from qmill.server import metrics as metrics_lib
from qmill.server.quantizer import capabilities, stream

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
    ) -> None:
        self._config = config
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
        try:
            async for response in stream.quantize_stream(
                request_iterator,
                self._executor,
                self._config.max_tensor_bytes,
                stats,
                limiter=self._limiter,
                metrics=self._metrics,
                upload_tensors=self._upload_tensors,
            ):
                yield response
        finally:
            # Joins the call's one log line (written by the observability interceptor).
            calls.annotate(
                tensors_in=stats.tensors_received,
                quantized=stats.tensors_quantized,
                tensor_bytes_in=stats.bytes_received,
                tensor_bytes_out=stats.bytes_sent,
            )
