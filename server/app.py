"""Builds, starts and stops the qmill gRPC server."""

from __future__ import annotations

import asyncio
import errno
import logging
import pathlib
import signal
import socket
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from qmill.checkpoints.run import compilation_cache
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc
from qmill.server import auth, errors, limits, registry, tls
from qmill.server import config as config_lib
from qmill.server import metrics as metrics_lib
from qmill.server.admin import servicer as admin_servicer
from qmill.server.calibrator import expiry as calibration_expiry
from qmill.server.calibrator import language_model as lm_calibrations
from qmill.server.calibrator import servicer as calibrator_servicer
from qmill.server.calibrator import store as calibration_store
from qmill.server.jobs import peers as jobs_peers
from qmill.server.jobs import servicer as jobs_servicer
from qmill.server.odml import servicer as odml_servicer
from qmill.server.quantizer import servicer as quantizer_servicer
from qmill.server.uploads import servicer as uploads_servicer
from qmill.server.uploads import store as upload_store

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Quantizer"].full_name
# The health name of liveness alone: SERVING while the process runs, even while the job database
# is unreachable (when "" reports NOT_SERVING, taking the replica out of the Service): a restart
# would not bring the database back.
LIVENESS_NAME = "liveness"
# How often a server whose jobs are in a shared database checks that it can reach it.
READINESS_SECONDS = 2.0


class Server:
    """A started server: its port, its health service, and an orderly stop."""

    def __init__(
        self,
        config: config_lib.ServerConfig,
        *,
        job_peer_backends: jobs_peers.JobPeerBackends | None = None,
    ) -> None:
        """`job_peer_backends` makes the fan-out backend of batch jobs under --job-peers; the
        composition root (qmill.cli.serve) supplies it, as the server does not import clients."""
        self.config = config
        _check_port_free(config)  # before anything is started that would have to be stopped
        # Before any service compiles: programs compiled by an earlier server load from disk.
        log.info("compilation cache: %s", compilation_cache.enable() or "off")
        for warning in tls.check_transport(config):
            log.warning("%s", warning)
        self.metrics = metrics_lib.Metrics()
        self.metrics_port: int | None = None
        self.limiter = _limiter(config, self.metrics)
        self.streams = limits.StreamLimitInterceptor(
            config.max_concurrent_streams, on_change=self.metrics.streams.set
        )
        self._executor = futures.ThreadPoolExecutor(
            max_workers=config.workers, thread_name_prefix="qmill-engine"
        )
        self._grpc = _grpc_server(config, self.metrics, self.streams)
        # Uploads and calibrations live under data_dir; the model registry names the models.
        data_dir = pathlib.Path(config.data_dir)
        self.uploads = upload_store.UploadStore(
            data_dir / "uploads",
            max_upload_bytes=config.max_upload_bytes,
            quota_bytes=config.upload_quota_bytes,
            expiry_seconds=config.upload_expiry_seconds,
        )
        self.calibrations = calibration_store.CalibrationStore(
            data_dir / "calibrations",
            expiry=calibration_expiry.Expiry(seconds=config.calibration_expiry_seconds),
        )
        # One for the server: what is running or being read is never swept.
        self.language_models = lm_calibrations.beside(self.calibrations)
        calibrator_servicer.sweep_expired(self.calibrations, self.language_models)
        self._add_services()
        self.jobs = jobs_servicer.add_to_server(
            self._grpc, config, self.metrics, job_peer_backends, limiter=self.limiter
        )
        self.health = _add_health(self._grpc, config)
        # Follows the job database when it is shared (readiness); started by start().
        self._readiness: asyncio.Task | None = None
        self.port = _bind(self._grpc, config)

    def _add_services(self) -> None:
        """Registers the qmill.v1 services but Jobs (whose runner the server starts and stops)."""
        config, executor = self.config, self._executor
        quantizer_servicer.add_to_server(
            quantizer_servicer.QuantizerServicer(
                config,
                executor,
                limiter=self.limiter,
                metrics=self.metrics,
                upload_tensors=self.uploads.tensors,
                calibrations=self.calibrations,
                language_models=self.language_models,
            ),
            self._grpc,
        )
        pb_grpc.add_AdminServicer_to_server(
            admin_servicer.AdminServicer(config, self.limiter, self.streams), self._grpc
        )
        pb_grpc.add_UploadsServicer_to_server(
            uploads_servicer.UploadsServicer(self.uploads), self._grpc
        )
        pb_grpc.add_CalibratorServicer_to_server(
            calibrator_servicer.CalibratorServicer(
                executor,
                self.uploads,
                self.calibrations,
                max_tensor_bytes=config.max_tensor_bytes,
                limiter=self.limiter,
                max_stats_bytes=config.max_calibration_stats_bytes,
                language_models=self.language_models,
            ),
            self._grpc,
        )
        backends = odml_servicer.Backends(
            resolve_model=registry.build,
            load_params=self.uploads.open_params,
            load_stats=self.calibrations.load_stats,
            upload_tensors=self.uploads.tensors,
        )
        pb_grpc.add_OdmlExporterServicer_to_server(
            odml_servicer.OdmlExporterServicer(executor, backends=backends), self._grpc
        )

    async def start(self) -> None:
        await self._grpc.start()
        self.jobs.start()  # resumes the jobs a previous server left QUEUED or RUNNING
        for name in ("", SERVICE_NAME, LIVENESS_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.jobs.store.shared:
            self._readiness = asyncio.create_task(self._watch_database())
        if self.config.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(self.config.host, self.config.metrics_port)
            log.info("metrics on http://%s:%d/metrics", self.config.host, self.metrics_port)
        log.info("qmill serving on %s:%d", self.config.host, self.port)
        # Where the server keeps what outlives a call: a user should not have to find out.
        data_dir = pathlib.Path(self.config.data_dir)
        log.info(
            "keeping uploads in %s, calibrations in %s, batch jobs in %s (--data-dir, --jobs-db)",
            data_dir / "uploads",
            data_dir / "calibrations",
            jobs_servicer.jobs_db_path(self.config),
        )

    async def stop(self, grace: float | None = None) -> None:
        """Reports NOT_SERVING, lets in-flight calls finish within the grace period, then stops."""
        if self._readiness is not None:
            self._readiness.cancel()
        await self.health.enter_graceful_shutdown()
        await self._grpc.stop(self.config.grace_seconds if grace is None else grace)
        # After the calls: the running job stops at its next tensor, left RUNNING for resuming.
        await asyncio.to_thread(self.jobs.stop)
        # The database connection; a SQLite file stays open: a job left behind by a cancel may
        # still write to it.
        if self.jobs.store.shared:
            self.jobs.store.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.metrics.stop_http()
        log.info("qmill stopped")

    async def _watch_database(self) -> None:
        """Readiness follows the job database: NOT_SERVING while it cannot be reached (every
        Jobs call would fail), SERVING again once it can. The same query keeps the qmill_jobs
        gauge current: other replicas change the jobs too."""
        reachable = True
        while True:
            await asyncio.sleep(READINESS_SECONDS)
            try:
                self.metrics.set_jobs_by_state(await asyncio.to_thread(self.jobs.store.counts))
                now = True
            except errors.Unavailable as e:
                now = False
                if reachable:
                    log.warning("not ready: %s", e)
            if now != reachable:
                if now:
                    log.info("ready: the job database answers again")
                status = health_pb2.HealthCheckResponse.SERVING if now else _NOT_SERVING
                for name in ("", SERVICE_NAME):
                    await self.health.set(name, status)
                reachable = now

    async def wait(self) -> None:
        await self._grpc.wait_for_termination()


_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _limiter(config: config_lib.ServerConfig, metrics: metrics_lib.Metrics) -> limits.ByteLimiter:
    metrics.inflight_limit.set(config.max_inflight_bytes)
    return limits.ByteLimiter(
        config.max_inflight_bytes,
        config.max_tenant_inflight_bytes,
        wait_seconds=config.max_wait_seconds,
        idle_seconds=config.idle_timeout_seconds or None,
        on_change=metrics.inflight_bytes.set,
        on_waiting=metrics.waiting_calls.set,
    )


def _grpc_server(
    config: config_lib.ServerConfig,
    metrics: metrics_lib.Metrics,
    streams: limits.StreamLimitInterceptor,
) -> grpc.aio.Server:
    # Outermost first: every call gets a request id and is counted, even when auth refuses it;
    # auth runs before the stream limit so unauthenticated calls cannot take stream slots.
    interceptors = [
        metrics_lib.ObservabilityInterceptor(metrics),
        auth.AuthInterceptor(config.tokens, tenant_from_client_cert=config.tenant_from_client_cert),
        streams,
    ]
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        # gRPC sets SO_REUSEPORT by default: a second server on the same port would start, and
        # the kernel would share the connections between the two.
        ("grpc.so_reuseport", 0),
    ]
    # No compression: tensor bytes barely compress, and it would cost CPU on both sides.
    return grpc.aio.server(
        options=options, interceptors=interceptors, compression=grpc.Compression.NoCompression
    )


def _add_health(
    server: grpc.aio.Server, config: config_lib.ServerConfig
) -> health.aio.HealthServicer:
    """The health service, and reflection of every service when the config asks for it."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if config.reflection:
        # Every qmill.v1 service (Quantizer, Uploads, Calibrator, OdmlExporter, Jobs, Admin).
        ours = tuple(s.full_name for s in pb.DESCRIPTOR.services_by_name.values())
        names = (*ours, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
        reflection.enable_server_reflection((*names, reflection.SERVICE_NAME), server)
    return servicer


def _port_in_use(config: config_lib.ServerConfig) -> errors.FailedPrecondition:
    return errors.FailedPrecondition(
        f"port {config.port} on {config.host} is already in use (another qmill serve?): stop "
        "that server or choose another --port (--port 0 picks a free one)"
    )


def _check_port_free(config: config_lib.ServerConfig) -> None:
    """Refuses a port another socket listens on, before gRPC logs its own bind errors.

    Raises:
        errors.FailedPrecondition: the port is taken.
    """
    if config.port == 0 or config.host.startswith("unix"):
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            config.host.strip("[]"), config.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except OSError:
        return  # an address gRPC itself will refuse, with its own message
    with socket.socket(family, kind, proto) as probe:
        # As gRPC binds: a port in TIME_WAIT is free; one with a listener is not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise _port_in_use(config) from None


def _bind(server: grpc.aio.Server, config: config_lib.ServerConfig) -> int:
    address, credentials = f"{config.host}:{config.port}", tls.server_credentials(config)
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError:  # gRPC's "Failed to bind": taken between the check and now
        raise _port_in_use(config) from None
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    return port


async def create_server(
    config: config_lib.ServerConfig,
    *,
    job_peer_backends: jobs_peers.JobPeerBackends | None = None,
) -> Server:
    """A started server; `server.port` is the bound port (useful with port 0)."""
    server = Server(config, job_peer_backends=job_peer_backends)
    await server.start()
    return server


async def serve(
    config: config_lib.ServerConfig,
    *,
    job_peer_backends: jobs_peers.JobPeerBackends | None = None,
) -> None:
    """Runs until SIGTERM or SIGINT, then stops gracefully."""
    server = await create_server(config, job_peer_backends=job_peer_backends)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        await stopping.wait()
        log.info("signal received: stopping within %.1fs", config.grace_seconds)
    finally:
        await server.stop()
