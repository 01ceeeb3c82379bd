"""The Quantizer service: a thin adapter from RPCs to the stream handler and capabilities."""

from __future__ import annotations

import logging
from concurrent import futures

from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc
from qmill.server import capabilities, errors, quantize_stream
from qmill.server import config as config_lib

log = logging.getLogger(__name__)


class QuantizerServicer(pb_grpc.QuantizerServicer):
    def __init__(self, config: config_lib.ServerConfig, executor: futures.Executor) -> None:
        self._config = config
        self._executor = executor

    @errors.unary
    async def GetCapabilities(self, request, context) -> pb.GetCapabilitiesResponse:
        return capabilities.capabilities(self._config)

    @errors.streaming
    async def QuantizeParams(self, request_iterator, context):
        stats = quantize_stream.CallStats()
        outcome = "error"
        try:
            async for response in quantize_stream.quantize_stream(
                request_iterator, self._executor, self._config.max_tensor_bytes, stats
            ):
                yield response
            outcome = "ok"
        finally:
            log.info(
                "QuantizeParams peer=%s outcome=%s tensors_in=%d quantized=%d bytes_in=%d "
                "bytes_out=%d seconds=%.3f",
                context.peer(),
                outcome,
                stats.tensors_received,
                stats.tensors_quantized,
                stats.bytes_received,
                stats.bytes_sent,
                stats.summary().seconds,
            )
