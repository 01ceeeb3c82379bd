"""Prometheus metrics and the one log line per RPC.

Each Server owns a `Metrics` with its own CollectorRegistry (several servers in one test process
must not share counters) and, when asked, serves it over HTTP on its own port. The observability
interceptor is the outermost one: it gives every call a request id (the client's `x-request-id`
metadata when valid, a fresh one otherwise) that comes back in the trailing metadata, counts
calls by RPC and status code and the bytes of every message, and logs one key=value line.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import grpc
import prometheus_client
from prometheus_client import core as prom_core
from prometheus_client import registry as prom_registry

from qmill.server import auth, calls

log = logging.getLogger(__name__)

REQUEST_ID_KEY = "x-request-id"
_VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
# Probes call health every few seconds; their lines would drown the real ones at INFO.
_QUIET_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
# From a small tensor on a GPU (~1 ms) to a huge one on a CPU (minutes).
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class _DeviceMemory(prom_registry.Collector):
    """Reads JAX's per-device memory statistics at scrape time (absent on CPU backends)."""

    def collect(self) -> Iterator[prom_core.GaugeMetricFamily]:
        family = prom_core.GaugeMetricFamily(
            "qmill_device_memory_bytes",
            "Accelerator memory as the JAX runtime reports it",
            labels=("device", "kind"),
        )
        import jax  # lazy: scrapes only; the module stays importable without touching devices

        for device in jax.local_devices():
            stats = device.memory_stats() if hasattr(device, "memory_stats") else None
            for key, kind in (
                ("bytes_in_use", "in_use"),
                ("peak_bytes_in_use", "peak"),
                ("bytes_limit", "limit"),
            ):
                if stats and key in stats:
                    family.add_metric([f"{device.platform}:{device.id}", kind], stats[key])
        yield family


class Metrics:
    """The counters of one server. Methods are safe to call from the event loop and threads."""

    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry()
        r = self.registry
        self.calls = prometheus_client.Counter(
            "qmill_calls", "RPCs finished, by RPC and status code", ("rpc", "code"), registry=r
        )
        self.call_seconds = prometheus_client.Histogram(
            "qmill_call_seconds", "RPC duration", ("rpc",), buckets=_LATENCY_BUCKETS, registry=r
        )
        self.received_bytes = prometheus_client.Counter(
            "qmill_received_bytes", "Serialized request bytes, by RPC", ("rpc",), registry=r
        )
        self.sent_bytes = prometheus_client.Counter(
            "qmill_sent_bytes", "Serialized response bytes, by RPC", ("rpc",), registry=r
        )
        self.tensors = prometheus_client.Counter(
            "qmill_tensors", "Tensors answered, by result (quantized, kept)", ("result",),
            registry=r,
        )  # fmt: skip
        self.quantize_seconds = prometheus_client.Histogram(
            "qmill_quantize_seconds",
            "Engine time per quantized tensor",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inflight_bytes = prometheus_client.Gauge(
            "qmill_inflight_bytes", "Tensor bytes reserved by calls in progress", registry=r
        )
        self.inflight_limit = prometheus_client.Gauge(
            "qmill_inflight_limit_bytes", "Server-wide limit on in-flight bytes", registry=r
        )
        self.waiting_calls = prometheus_client.Gauge(
            "qmill_waiting_calls",
            "Calls queued for in-flight bytes (first come, first served)",
            registry=r,
        )
        self.streams = prometheus_client.Gauge(
            "qmill_active_streams", "Streaming RPCs in progress", registry=r
        )
        self.rejected = prometheus_client.Counter(
            "qmill_rejected", "Calls refused by a limit or by authentication", ("reason",),
            registry=r,
        )  # fmt: skip
        self.jobs = prometheus_client.Gauge(
            "qmill_jobs", "Batch jobs by state", ("state",), registry=r
        )
        r.register(_DeviceMemory())
        self._http: Any = None

    def set_jobs_by_state(self, counts: Mapping[str, int]) -> None:
        """Sets the jobs gauge to `counts` (state → number); states not given drop to 0."""
        for state in {s for (s,) in _label_values(self.jobs)} - set(counts):
            self.jobs.labels(state=state).set(0)
        for state, n in counts.items():
            self.jobs.labels(state=state).set(n)

    def value(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        """A sample's current value, e.g. value("qmill_inflight_bytes") (for tests and tools)."""
        return self.registry.get_sample_value(name, dict(labels or {}))

    def serve_http(self, host: str, port: int) -> int:
        """Serves /metrics on host:port (0 picks a port) in a daemon thread; returns the port."""
        server, _ = prometheus_client.start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return server.server_port

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


def _label_values(metric: Any) -> list[tuple[str, ...]]:
    return [tuple(s.labels.values()) for m in metric.collect() for s in m.samples]


def _request_id(metadata: Any) -> str:
    for key, value in metadata or ():
        if key == REQUEST_ID_KEY:
            value = value.decode() if isinstance(value, bytes) else value
            if _VALID_REQUEST_ID.fullmatch(value):
                return value
    return uuid.uuid4().hex


def _status_at_exit(call: calls.CallContext, exc: BaseException | None) -> grpc.StatusCode:
    if exc is None:
        return call.code or grpc.StatusCode.OK
    if isinstance(exc, grpc.aio.AbortError):
        return call.code or grpc.StatusCode.UNKNOWN
    # Past the deadline, whatever surfaced (CancelledError, or grpc's error from reading a
    # request stream that is already gone) is the deadline's doing.
    remaining = call.time_remaining()
    if remaining is not None and remaining <= 0:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, BaseException) and not isinstance(exc, Exception):
        # Cancellation (client gone) or the generator closed under us.
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN  # what grpc sends for an unhandled exception


class ObservabilityInterceptor(grpc.aio.ServerInterceptor):
    """Request ids, call and byte counters, and one log line per RPC. Install it first."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        rpc = handler_call_details.method.lstrip("/")
        received = self._metrics.received_bytes.labels(rpc=rpc)
        sent = self._metrics.sent_bytes.labels(rpc=rpc)
        return calls.wrap_handler(
            handler,
            handler_call_details.method,
            self._around,
            on_request_bytes=received.inc,
            on_response_bytes=sent.inc,
        )

    @contextlib.asynccontextmanager
    async def _around(self, method: str, context: Any) -> AsyncIterator[calls.CallContext]:
        call = calls.CallContext(context, method, _request_id(context.invocation_metadata()))
        calls.bind(call)
        started = time.monotonic()
        exc: BaseException | None = None
        try:
            yield call
        except BaseException as e:
            exc = e
            raise
        finally:
            self._finish(call, exc, time.monotonic() - started)

    def _finish(self, call: calls.CallContext, exc: BaseException | None, seconds: float) -> None:
        rpc = call.method.lstrip("/")
        code = _status_at_exit(call, exc)
        self._metrics.calls.labels(rpc=rpc, code=code.name).inc()
        self._metrics.call_seconds.labels(rpc=rpc).observe(seconds)
        if code is grpc.StatusCode.UNAUTHENTICATED:
            self._metrics.rejected.labels(reason="unauthenticated").inc()
        elif code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._metrics.rejected.labels(reason="resource_exhausted").inc()
        fields = "".join(f" {k}={_quoted(v)}" for k, v in call.fields.items())
        level = logging.DEBUG if call.method.startswith(_QUIET_PREFIXES) else logging.INFO
        log.log(
            level,
            "rpc=%s outcome=%s code=%s request_id=%s tenant=%s peer=%s seconds=%.3f%s%s",
            rpc,
            "ok" if code is grpc.StatusCode.OK else "error",
            code.name,
            call.request_id,
            principal.tenant if (principal := auth.bound_principal()) else "-",
            call.peer(),
            seconds,
            fields,
            f" details={_quoted(call.details)}" if call.details and code.name != "OK" else "",
        )


def _quoted(value: object) -> str:
    text = str(value)
    return text if text and re.fullmatch(r"[^\s\"=]+", text) else '"' + text.replace('"', "'") + '"'
