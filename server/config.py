"""Server configuration: one frozen record, built from flags or by tests."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qmill.server import auth

MiB = 1024 * 1024
DATA_DIR_ENV = "QMILL_DATA_DIR"
JOBS_ROOT_ENV = "QMILL_JOBS_ROOT"
JOBS_URL_ROOT_ENV = "QMILL_JOBS_URL_ROOT"
JOB_PEER_TOKEN_ENV = "QMILL_JOB_PEER_TOKEN"
JOBS_DB_ENV = "QMILL_JOBS_DB"


def default_data_dir() -> str:
    return os.environ.get(DATA_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "qmill")


def split_url_roots(*values: str) -> tuple[str, ...]:
    """--jobs-url-root values (each may be comma-separated) as one tuple, blanks dropped."""
    return tuple(part.strip() for v in values for part in v.split(",") if part.strip())


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    # Interface to bind; 127.0.0.1 keeps a laptop server private, 0.0.0.0 serves a cluster.
    host: str = "127.0.0.1"
    # TCP port; 0 picks a free one (tests).
    port: int = 50051
    # Largest gRPC message either way; chunks are <= 4 MiB, so 8 MiB leaves room for headers.
    max_message_bytes: int = 8 * MiB
    # Largest single tensor accepted; bigger ones get RESOURCE_EXHAUSTED before any byte is kept.
    max_tensor_bytes: int = 8 * 1024 * MiB
    # Threads running JAX work, shared by all calls (JAX itself uses every core per call).
    workers: int = 2
    # Seconds in-flight calls get to finish after SIGTERM.
    grace_seconds: float = 10.0
    # Expose gRPC server reflection (for grpcurl and similar tools); off: it maps the API for
    # anyone who can connect.
    reflection: bool = False

    # Security (server/tls.py has the policy on when plaintext is allowed).
    # PEM server certificate chain and private key; both or neither.
    tls_cert: str | None = None
    tls_key: str | None = None
    # PEM CA that client certificates must chain to; set → mTLS (clients without one are refused).
    client_ca: str | None = None
    # Plaintext on a non-loopback interface, explicitly asked for (--insecure).
    insecure: bool = False
    # Bearer tokens → tenant and role: a TokenTable, or a TokenFile that re-reads its file when it
    # changes; None: no authentication (every caller is a local admin).
    tokens: auth.TokenTable | auth.TokenFile | None = None
    # Under mTLS, a call without a bearer token is tenant <client certificate's subject CN>, role
    # user (--tenant-from-client-cert); tokens, when given, still win.
    tenant_from_client_cert: bool = False

    # Limits (server/limits.py). Over any of them a call gets RESOURCE_EXHAUSTED + a retry hint.
    # Streaming RPCs open at once (health probes not counted).
    max_concurrent_streams: int = 64
    # Tensor bytes being received, waiting or quantized, all calls together: bounds server memory.
    max_inflight_bytes: int = 16 * 1024 * MiB
    # The same for one tenant, so one tenant cannot take all of it.
    max_tenant_inflight_bytes: int = 8 * 1024 * MiB
    # Seconds a call may wait in the (first come, first served) queue for in-flight room before
    # RESOURCE_EXHAUSTED; short, so a busy replica sends clients elsewhere rather than hold them.
    max_wait_seconds: float = 5.0
    # Seconds a call may send nothing while a tensor of it is partly received: then it ends with
    # DEADLINE_EXCEEDED and its bytes are given back, so a stalled client cannot hold its
    # tenant's in-flight room (what it holds grows with the data it sent). 0: no limit.
    idle_timeout_seconds: float = 20.0
    # Largest statistics one calibration may keep (on disk, and on the device while it runs): a
    # GPTQ calibration holds d_in² float32 per weight. Over it Calibrate is RESOURCE_EXHAUSTED.
    max_calibration_stats_bytes: int = 4 * 1024 * MiB
    # Largest upload (a checkpoint sent for a job or calibration), in bytes.
    max_upload_bytes: int = 256 * 1024 * MiB
    # Bytes of live uploads one tenant may hold on disk (a shared blob counts for each upload).
    upload_quota_bytes: int = 512 * 1024 * MiB
    # Seconds an upload is kept after its last byte arrived (then swept with its blob if unused).
    upload_expiry_seconds: float = 7 * 24 * 3600.0
    # Seconds a calibration (Calibrate's statistics, a language model's kept layers) is kept
    # after its last use: a calibrate call continuing it, a QuantizeParams or ExportOdml reading
    # it. Swept at start and on calibrate calls, never while running or read; 0: kept forever.
    calibration_expiry_seconds: float = 7 * 24 * 3600.0

    # Storage. Directory of uploads and calibrations; $QMILL_DATA_DIR or ~/.cache/qmill.
    data_dir: str = dataclasses.field(default_factory=lambda: default_data_dir())
    # Where batch jobs are kept (server/jobs/store.py): a SQLite file (kept across restarts), or
    # a PostgreSQL URL (postgresql://...) whose one queue every replica given it shares. None
    # ($QMILL_JOBS_DB unset, the way to pass a URL with a password): jobs.sqlite3 in data_dir.
    jobs_db: str | None = dataclasses.field(
        default_factory=lambda: os.environ.get(JOBS_DB_ENV) or None, repr=False
    )
    # Seconds a runner's claim on a job lasts without renewal (renewed every 2 s, or a third of
    # it): after a replica dies, its job waits this long before another one resumes it.
    job_lease_seconds: float = 30.0
    # Jobs of one tenant running at once, all replicas sharing the database together (0: no
    # limit; one server runs one job at a time anyway).
    max_tenant_jobs: int = 0
    # Directory of one directory per tenant; a job's paths must stay inside its tenant's
    # (server/jobs/paths.py). None ($QMILL_JOBS_ROOT unset): jobs are refused when tokens are
    # set, and may use any path in the single-user (no tokens) mode.
    jobs_root: str | None = dataclasses.field(
        default_factory=lambda: os.environ.get(JOBS_ROOT_ENV) or None
    )
    # Single-user mode (no tokens, no jobs_root) on a non-loopback host lets anyone who reaches
    # the port run jobs that read and write any file the server's user can; such jobs are refused
    # unless this is set (--allow-open-jobs), e.g. inside a network only the owner can reach.
    allow_open_jobs: bool = False
    # Object-store prefixes (gs://, s3://) of one prefix per tenant: a job's URLs must lie below
    # `<root>/<tenant>/` of one of them (server/jobs/urls.py). Empty ($QMILL_JOBS_URL_ROOT unset,
    # comma-separated): jobs with URLs are refused.
    jobs_url_roots: tuple[str, ...] = dataclasses.field(
        default_factory=lambda: split_url_roots(os.environ.get(JOBS_URL_ROOT_ENV, ""))
    )
    # Replicas a batch job spreads its tensors over, as `qmill quantize --server` does: a:1,b:2
    # or dns:///name:port, resolved when each job starts (list this server too to use its own
    # engine). None: jobs quantize in-process. The peers see the job's tensors as the tenant of
    # job_peer_token ($QMILL_JOB_PEER_TOKEN); job_peer_tls_ca: their CA, when they use TLS.
    job_peers: str | None = None
    job_peer_token: str | None = dataclasses.field(
        default_factory=lambda: os.environ.get(JOB_PEER_TOKEN_ENV) or None, repr=False
    )
    job_peer_tls_ca: str | None = None

    # Observability. Port of the Prometheus /metrics endpoint (on `host`); None: not served,
    # 0: a free port (tests).
    metrics_port: int | None = None
