"""The `qmill` command: quantize, serve, inspect, capabilities.

User errors print one line and exit 1; tracebacks are kept for bugs.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading
import time
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from qmill.client import (
    admin,
    calibrate,
    checkpoints,
    credentials,
    errors,
    export_odml,
    fanout,
    job,
    jobs,
    recipes,
    report,
    retry,
    uploads,
)

USER_ERRORS = (
    errors.QmillError,
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qmill", description="Quantization as a service for JAX checkpoints."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    q = sub.add_parser("quantize", help="quantize a checkpoint (Orbax, safetensors, npz)")
    q.add_argument("source", help="checkpoint: Orbax directory, .safetensors file/set, or .npz")
    q.add_argument("-o", "--output", required=True, help="where to write the quantized checkpoint")
    q.add_argument(
        "--recipe",
        default="int8",
        help=f"preset ({', '.join(recipes.PRESETS)}) or a TOML recipe file (default: int8)",
    )
    q.add_argument(
        "--server",
        help="HOST:PORT of a qmill server; without it the engine runs in-process. Several "
        "(a:1,b:2,...) or dns:///NAME:PORT (every address NAME resolves to) spread the "
        "tensors over all of them",
    )
    q.add_argument(
        "--format",
        choices=("orbax", "safetensors", "npz"),
        help="output format (default: the output's suffix, .npz or .safetensors; else the input's)",
    )
    q.add_argument("--overwrite", action="store_true", help="replace an existing output")
    q.add_argument(
        "--restart",
        action="store_true",
        help="discard the partial output of an interrupted run instead of resuming it",
    )
    q.add_argument(
        "--retries",
        type=int,
        default=retry.Backoff().retries,
        help="times to retry, with exponential backoff, while the server is unavailable "
        "(default %(default)s; each retry resumes where the last attempt stopped)",
    )
    q.add_argument("--report-json", help="also write the per-tensor report as JSON to this file")
    q.add_argument("--timeout", type=float, help="seconds before the call is abandoned")
    q.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no table")
    credentials.add_arguments(q)

    s = sub.add_parser("serve", help="run the qmill gRPC server")
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=50051, help="port (default 50051; 0 picks one)")
    s.add_argument("--workers", type=int, default=2, help="threads running the engine")
    s.add_argument("--max-tensor-bytes", type=int, help="largest tensor accepted")
    s.add_argument("--grace", type=float, default=10.0, help="seconds to finish calls on SIGTERM")
    s.add_argument("--reflection", action="store_true", help="enable gRPC server reflection")
    s.add_argument("--log-level", default="INFO")
    sec = s.add_argument_group(
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
    lim = s.add_argument_group("limits", "over a limit: RESOURCE_EXHAUSTED with a retry hint")
    lim.add_argument("--max-concurrent-streams", type=int, help="streaming calls at once")
    lim.add_argument("--max-inflight-bytes", type=int, help="tensor bytes held, all calls")
    lim.add_argument("--max-tenant-inflight-bytes", type=int, help="the same, per tenant")
    lim.add_argument(
        "--max-wait-seconds", type=float, help="queueing for in-flight room, at most (default 5)"
    )
    lim.add_argument("--max-upload-bytes", type=int, help="largest upload accepted")
    lim.add_argument("--upload-quota-bytes", type=int, help="upload bytes one tenant may hold")
    lim.add_argument("--upload-expiry-seconds", type=float, help="seconds an upload is kept")
    s.add_argument("--data-dir", help="uploads and calibrations ($QMILL_DATA_DIR, ~/.cache/qmill)")
    s.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on this port")
    s.add_argument(
        "--jobs-db", help="SQLite file of batch jobs (default: jobs.sqlite3 in the data dir)"
    )
    s.add_argument(
        "--job-peers",
        metavar="SERVERS",
        help="spread each batch job's tensors over these replicas (a:1,b:2 or dns:///NAME:PORT; "
        "include this server to use it too); token for them in $QMILL_JOB_PEER_TOKEN",
    )
    s.add_argument("--job-peer-tls-ca", metavar="PEM", help="CA of the --job-peers (TLS)")
    s.add_argument(
        "--jobs-root",
        metavar="DIR",
        help="confine each tenant's batch jobs (qmill submit) to DIR/<tenant>/ ($QMILL_JOBS_ROOT); "
        "needed for jobs when tokens are set; with neither (single-user), jobs use any path",
    )
    s.add_argument(
        "--jobs-url-root",
        metavar="URL",
        action="append",
        default=[],
        help="allow batch jobs on object-store URLs below URL/<tenant>/ (gs:// or s3://; "
        "repeat or comma-separate for several; $QMILL_JOBS_URL_ROOT); needs qmill[objectstore]",
    )

    jobs.add_commands(
        sub, recipe_help=f"preset ({', '.join(recipes.PRESETS)}) or a TOML recipe file"
    )

    uploads.add_command(sub)
    admin.add_command(sub)
    calibrate.add_command(sub)

    i = sub.add_parser("inspect", help="list a checkpoint's tensors")
    i.add_argument("checkpoint")

    c = sub.add_parser("capabilities", help="what a server supports")
    c.add_argument("--server", required=True, help="HOST:PORT")
    credentials.add_arguments(c)

    export_odml.add_command(sub)
    return parser


def _quantize(args: argparse.Namespace, out: Console, err: Console) -> int:
    recipe = recipes.load(args.recipe)
    started = time.monotonic()
    quiet = args.quiet or not err.is_terminal

    def attempt(restart: bool) -> list[job.ReportRow]:
        if args.server and fanout.is_fanout(args.server):
            backend = fanout.FanoutClient(
                args.server,
                timeout=args.timeout,
                credentials=credentials.from_args(args),
                on_replica_lost=lambda address, e: print(
                    f"qmill: replica {address} failed ({e.code}); its tensors go to the others",
                    file=sys.stderr,
                    flush=True,
                ),
            )
        elif args.server:
            from qmill.client import remote

            backend = remote.Client(
                args.server, timeout=args.timeout, credentials=credentials.from_args(args)
            )
        else:
            from qmill.client import embedded

            backend = embedded.EmbeddedClient()
        with backend, contextlib.nullcontext() if quiet else report.ProgressBar(err) as bar:
            return job.quantize_checkpoint(
                args.source,
                args.output,
                recipe,
                backend=retry.NoticeAnswers(backend, answered),
                output_format=args.format,
                overwrite=args.overwrite,
                progress=bar,
                restart=restart,
            )

    # Only the first attempt may discard a partial output; retries resume it. A server that
    # never answered is more likely a wrong address than a restart: that fails at once.
    attempts = iter([args.restart])
    answered = threading.Event()
    rows = retry.call(
        lambda: attempt(next(attempts, False)),
        retry.Backoff(retries=max(0, args.retries) if args.server else 0),
        on_retry=lambda line: print(f"qmill: {line}", file=sys.stderr, flush=True),
        retry_if=lambda _: answered.is_set(),
    )
    seconds = time.monotonic() - started
    if not args.quiet:
        out.print(report.quality_table(rows))
    out.print(report.totals_line(rows, seconds) + f" → {args.output}")
    if args.report_json:
        report.write_json(rows, args.report_json)
    return 0


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from qmill.server import app, auth, config  # lazy: the server pulls in jax

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    fields = {
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
        "jobs_db": args.jobs_db,
    }
    for name in (
        "max_tensor_bytes",
        "max_concurrent_streams",
        "max_inflight_bytes",
        "max_tenant_inflight_bytes",
        "max_upload_bytes",
        "upload_quota_bytes",
        "upload_expiry_seconds",
        "data_dir",
        "jobs_root",
        "job_peers",
        "job_peer_tls_ca",
    ):
        if getattr(args, name):
            fields[name] = getattr(args, name)
    if args.max_wait_seconds is not None:  # 0 is meaningful: refuse rather than queue
        fields["max_wait_seconds"] = args.max_wait_seconds
    if args.jobs_url_root:  # else $QMILL_JOBS_URL_ROOT, read by the config
        fields["jobs_url_roots"] = config.split_url_roots(*args.jobs_url_root)
    asyncio.run(app.serve(config.ServerConfig(**fields)))
    return 0


def _inspect(args: argparse.Namespace, out: Console) -> int:
    with checkpoints.open_source(args.checkpoint) as source:
        entries = source.entries()
        table = Table(title=f"{args.checkpoint} ({source.format})")
        for name in ("path", "dtype", "shape", "bytes"):
            table.add_column(name, justify="right" if name == "bytes" else "left")
        for e in entries:
            table.add_row(
                e.path, e.dtype.name, "×".join(map(str, e.shape)) or "scalar", f"{e.nbytes:,}"
            )
    out.print(table)
    out.print(f"{len(entries)} tensors, {sum(e.nbytes for e in entries):,} bytes")
    return 0


def _capabilities(args: argparse.Namespace, out: Console) -> int:
    from qmill.client import remote

    with remote.Client(args.server, credentials=credentials.from_args(args)) as client:
        caps = client.capabilities()
    out.print(
        f"qmill {caps.qmill_version} (jax {caps.jax_version}) on {caps.device_kind}: "
        f"{caps.device_description}"
    )
    out.print("qtypes: " + ", ".join(caps.qtypes))
    out.print("calibration methods: " + ", ".join(caps.calibration_methods))
    out.print(f"max tensor bytes: {caps.max_tensor_bytes:,}")
    for m in caps.models:  # for `qmill calibrate --model NAME --config '{...}'`
        fields = ", ".join(f"{f.name}: {f.type} = {f.default_json}" for f in m.config_fields)
        out.print(f"model {m.name} ({m.origin}): {m.description} {{{fields}}}", markup=False)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out, err = Console(), Console(stderr=True)
    try:
        if args.command == "quantize":
            return _quantize(args, out, err)
        if args.command == "serve":
            return _serve(args)
        if args.command == "inspect":
            return _inspect(args, out)
        if args.command == "export-odml":
            return export_odml.run_command(
                args, lambda line: out.print(line, markup=False, highlight=False, soft_wrap=True)
            )
        if args.command == "admin":
            return admin.run_command(
                args, lambda line: out.print(line, markup=False, highlight=False, soft_wrap=True)
            )
        if args.command in ("upload", "calibrate"):
            module = uploads if args.command == "upload" else calibrate
            return module.run_command(
                args, lambda line: out.print(line, markup=False, highlight=False, soft_wrap=True)
            )
        if args.command in ("submit", "jobs"):
            return jobs.run_command(
                args, lambda line: out.print(line, markup=False, highlight=False, soft_wrap=True)
            )
        return _capabilities(args, out)
    except USER_ERRORS as e:
        print(f"qmill: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "qmill: interrupted; no output was written under the final name (quantize: "
            "re-run the same command to resume)",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
