"""`qmill serve`: the server's flags, the ServerConfig they make, and the run.

The `qmill` dispatcher (qmill.cli) builds its `serve` subcommand from here. Importing this module
does not import JAX; `run` does (the server's services pull it in).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable
from typing import Any

from qmill.server import auth, errors
from qmill.server import config as config_lib

# Names of flags copied into ServerConfig only when given (else the config's default applies).
_OPTIONAL_FIELDS = (
    "max_tensor_bytes",
    "max_concurrent_streams",
    "max_inflight_bytes",
    "max_tenant_inflight_bytes",
    "max_upload_bytes",
    "max_calibration_stats_bytes",
    "upload_quota_bytes",
    "upload_expiry_seconds",
    "data_dir",
    "jobs_root",
    "job_peers",
    "job_peer_tls_ca",
    "jobs_db",
    "job_lease_seconds",
    "max_tenant_jobs",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `qmill serve`."""
    parser.description = (
        "Serve qmill.v1 over gRPC. Uploads, calibrations and the batch-job database "
        f"(jobs.sqlite3) are kept in the data dir: {config_lib.default_data_dir()} "
        f"(--data-dir; ${config_lib.DATA_DIR_ENV}, else ~/.cache/qmill)."
    )
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=50051, help="port (default 50051; 0 picks one)")
    parser.add_argument("--workers", type=int, default=2, help="threads running the engine")
    parser.add_argument("--max-tensor-bytes", type=int, help="largest tensor accepted")
    parser.add_argument(
        "--max-calibration-stats-bytes",
        type=int,
        help="largest statistics one calibration keeps (GPTQ: d_in² float32 per weight)",
    )
    parser.add_argument(
        "--grace", type=float, default=10.0, help="seconds to finish calls on SIGTERM"
    )
    parser.add_argument("--reflection", action="store_true", help="enable gRPC server reflection")
    parser.add_argument("--log-level", default="INFO")
    _add_security(parser)
    _add_limits(parser)
    parser.add_argument(
        "--data-dir",
        help="where uploads, calibrations and the jobs database are kept (default: "
        "$QMILL_DATA_DIR, else ~/.cache/qmill)",
    )
    parser.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    _add_jobs(parser)


def _add_security(parser: argparse.ArgumentParser) -> None:
    sec = parser.add_argument_group(
        "security", "no flags: plaintext, no tokens, loopback only (see README, Security)"
    )
    sec.add_argument("--tls-cert", metavar="PEM", help="server certificate chain")
    sec.add_argument("--tls-key", metavar="PEM", help="server private key")
    sec.add_argument("--client-ca", metavar="PEM", help="require client certificates (mTLS)")
    sec.add_argument(
        "--tokens",
        metavar="FILE",
        help="token table, TOML or JSON, re-read when it changes ($QMILL_TOKENS: fixed)",
    )
    sec.add_argument(
        "--tenant-from-client-cert",
        action="store_true",
        help="under mTLS, a call without a token is tenant <client certificate CN>, role user",
    )
    sec.add_argument(
        "--insecure", action="store_true", help="allow plaintext on a non-loopback --host"
    )


def _add_limits(parser: argparse.ArgumentParser) -> None:
    lim = parser.add_argument_group("limits", "over a limit: RESOURCE_EXHAUSTED with a retry hint")
    lim.add_argument("--max-concurrent-streams", type=int, help="streaming calls at once")
    lim.add_argument("--max-inflight-bytes", type=int, help="tensor bytes held, all calls")
    lim.add_argument("--max-tenant-inflight-bytes", type=int, help="the same, per tenant")
    lim.add_argument(
        "--max-wait-seconds", type=float, help="queueing for in-flight room, at most (default 5)"
    )
    lim.add_argument(
        "--idle-timeout",
        type=float,
        help="seconds a call may send nothing mid-tensor before DEADLINE_EXCEEDED "
        "(default 20; 0: none)",
    )
    lim.add_argument("--max-upload-bytes", type=int, help="largest upload accepted")
    lim.add_argument("--upload-quota-bytes", type=int, help="upload bytes one tenant may hold")
    lim.add_argument("--upload-expiry-seconds", type=float, help="seconds an upload is kept")
    lim.add_argument(
        "--calibration-expiry-seconds",
        type=_seconds,
        help="seconds a calibration is kept after its last use (a calibrate call resuming it, "
        "a quantize or export reading it), then removed (default 604800: 7 days; 0: kept)",
    )


def _add_jobs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--jobs-db",
        metavar="FILE|URL",
        help="where batch jobs are kept: a SQLite file (default: jobs.sqlite3 in the data dir), "
        "or postgresql://... shared by every replica given it ($QMILL_JOBS_DB; needs "
        "qmill[postgres])",
    )
    parser.add_argument(
        "--job-lease-seconds",
        type=float,
        help="how long a replica's claim on a running job lasts unrenewed: the wait before "
        "another replica resumes the job of a dead one (default 30)",
    )
    parser.add_argument(
        "--max-tenant-jobs",
        type=int,
        help="jobs of one tenant running at once across the replicas sharing --jobs-db "
        "(default 0: no limit)",
    )
    parser.add_argument(
        "--job-peers",
        metavar="SERVERS",
        help="spread each batch job's tensors over these replicas (a:1,b:2 or dns:///NAME:PORT; "
        "include this server to use it too); token for them in $QMILL_JOB_PEER_TOKEN",
    )
    parser.add_argument("--job-peer-tls-ca", metavar="PEM", help="CA of the --job-peers (TLS)")
    parser.add_argument(
        "--jobs-root",
        metavar="DIR",
        help="confine each tenant's batch jobs (qmill submit) to DIR/<tenant>/ ($QMILL_JOBS_ROOT); "
        "needed for jobs when tokens are set; with neither (single-user), jobs use any path",
    )
    parser.add_argument(
        "--allow-open-jobs",
        action="store_true",
        help="run jobs on any server path with no tokens and no --jobs-root on a non-loopback "
        "--host (refused otherwise: anyone reaching the port could read and write your files)",
    )
    parser.add_argument(
        "--jobs-url-root",
        metavar="URL",
        action="append",
        default=[],
        help="allow batch jobs on object-store URLs below URL/<tenant>/ (gs:// or s3://; "
        "repeat or comma-separate for several; $QMILL_JOBS_URL_ROOT); needs qmill[objectstore]",
    )


def _seconds(text: str) -> float:
    """A duration flag's value: a number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds, 0 or more")
    return value


def config_from_args(args: argparse.Namespace) -> config_lib.ServerConfig:
    """The ServerConfig the flags describe (environment variables fill in what they omit)."""
    fields: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "workers": args.workers,
        "grace_seconds": args.grace,
        "reflection": args.reflection,
        "tls_cert": args.tls_cert,
        "tls_key": args.tls_key,
        "client_ca": args.client_ca,
        "insecure": args.insecure,
        "tokens": auth.TokenFile(args.tokens) if args.tokens else auth.TokenTable.from_env(),
        "tenant_from_client_cert": args.tenant_from_client_cert,
        "metrics_port": args.metrics_port,
        "allow_open_jobs": args.allow_open_jobs,
    }
    fields.update({name: getattr(args, name) for name in _OPTIONAL_FIELDS if getattr(args, name)})
    if args.max_wait_seconds is not None:  # 0 is meaningful: refuse rather than queue
        fields["max_wait_seconds"] = args.max_wait_seconds
    if args.idle_timeout is not None:  # 0 is meaningful: no idle limit
        fields["idle_timeout_seconds"] = args.idle_timeout
    if args.calibration_expiry_seconds is not None:  # 0 is meaningful: kept forever
        fields["calibration_expiry_seconds"] = args.calibration_expiry_seconds
    if args.jobs_url_root:  # else $QMILL_JOBS_URL_ROOT, read by the config
        fields["jobs_url_roots"] = config_lib.split_url_roots(*args.jobs_url_root)
    return config_lib.ServerConfig(**fields)


def run(args: argparse.Namespace, *, job_peer_backends: Callable[..., Any] | None = None) -> int:
    """Serves until SIGTERM/SIGINT. `job_peer_backends` (from the composition root) makes the
    backend of batch jobs when --job-peers is set."""
    from qmill.proto import memory

    memory.limit_arenas()  # before jax, grpc and the engine start their threads
    from qmill.server import app  # lazy: the services pull in jax

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    try:
        asyncio.run(app.serve(config_from_args(args), job_peer_backends=job_peer_backends))
    except errors.ServerError as e:
        # What the server needs and lacks at start (its job database unreachable, an extra not
        # installed): one line saying so, and a failed exit for the supervisor to retry.
        print(f"qmill serve: {e}", file=sys.stderr)
        return 1
    return 0
