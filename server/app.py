"""Builds, starts and stops the qmill gRPC server."""

from __future__ import annotations

import asyncio
import logging
import signal
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc
from qmill.server import config as config_lib
from qmill.server import servicer

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Quantizer"].full_name


class Server:
    """A started server: its port, its health service, and an orderly stop."""

    def __init__(self, config: config_lib.ServerConfig) -> None:
        self.config = config
        self._executor = futures.ThreadPoolExecutor(
            max_workers=config.workers, thread_name_prefix="qmill-engine"
        )
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
        ]
        self._grpc = grpc.aio.server(options=options)
        pb_grpc.add_QuantizerServicer_to_server(
            servicer.QuantizerServicer(config, self._executor), self._grpc
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        if config.reflection:
            names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
            reflection.enable_server_reflection((*names, reflection.SERVICE_NAME), self._grpc)
        self.port = self._grpc.add_insecure_port(f"{config.host}:{config.port}")
        if self.port == 0:
            raise OSError(f"could not bind {config.host}:{config.port}")

    async def start(self) -> None:
        await self._grpc.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("qmill serving on %s:%d", self.config.host, self.port)

    async def stop(self, grace: float | None = None) -> None:
        """Reports NOT_SERVING, lets in-flight calls finish within the grace period, then stops."""
        await self.health.enter_graceful_shutdown()
        await self._grpc.stop(self.config.grace_seconds if grace is None else grace)
        self._executor.shutdown(wait=False, cancel_futures=True)
        log.info("qmill stopped")

    async def wait(self) -> None:
        await self._grpc.wait_for_termination()


async def create_server(config: config_lib.ServerConfig) -> Server:
    """A started server; `server.port` is the bound port (useful with port 0)."""
    server = Server(config)
    await server.start()
    return server


async def serve(config: config_lib.ServerConfig) -> None:
    """Runs until SIGTERM or SIGINT, then stops gracefully."""
    server = await create_server(config)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        await stopping.wait()
        log.info("signal received: stopping within %.1fs", config.grace_seconds)
    finally:
        await server.stop()
