"""Server peak RSS (VmHWM) against --max-inflight-bytes, with several clients at once.

    python bench/rss_bench.py [--limits-mib 40,64,128] [--clients 6] [--tensor-mib 16]
                              [--tensors 4] [--workers 2] [--serve-arg=--flag=value ...]
                              [--json bench/results/rss.json]

For each limit, one `qmill serve --max-inflight-bytes LIMIT` process (its own, on loopback):
- idle: its VmHWM once it answers, before any tensor (the baseline: Python, jax, grpc loaded);
- cold: VmHWM after `--clients` CLI processes quantize the same synthetic safetensors checkpoint
  (`--tensors` f32 tensors of `--tensor-mib` each) through it at once: compiles included;
- warm: VmHWM reset (/proc/PID/clear_refs) to the current RSS, then the same clients again,
  with every compile cached: what a long-running server reaches.
The server's own qmill_inflight_bytes peak (Admin, from the limiter) is reported beside it, so
the part of RSS that --max-inflight-bytes does not count shows directly.
To find where the rest goes: `--serve-arg` passes more flags to `qmill serve`, `--grpc-option`
adds gRPC server options (grpc.http2.bdp_probe=0: flow-control windows stay small),
`--keep-freed` turns proto/memory.py's malloc tuning on (freed blocks kept for reuse; the server
no longer does), and the environment passes through (MALLOC_MMAP_THRESHOLD_=1048576
MALLOC_TRIM_THRESHOLD_=1048576: big buffers mapped and unmapped every time, nothing kept).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import e2e_bench  # the checkpoint maker and /proc readers, shared

MiB = 2**20
# `qmill serve` with extra gRPC server options (JSON list of [name, value]) and, with "1" as
# the second argument, with proto/memory.py's malloc tuning on: for finding where RSS goes.
_LAUNCHER = r"""
import json, sys, grpc
extra, keep = json.loads(sys.argv[1]), sys.argv[2] == "1"
real = grpc.aio.server
def server(*a, options=None, **k):
    return real(*a, options=[*(options or []), *map(tuple, extra)], **k)
grpc.aio.server = server
if keep:
    from qmill.proto import memory
    memory.keep_freed_buffers()
from qmill.cli import main
sys.exit(main.main(sys.argv[3:]))
"""


def _rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _inflight_peak_mb(address: str) -> float:
    """The limiter's peak of reserved bytes since start (Admin's GetServerInfo)."""
    from qmill.client import Client

    with Client(address, timeout=30) as client:
        return client.server_info().inflight_peak_bytes / MiB


def _clients(src: pathlib.Path, out: pathlib.Path, address: str, count: int, recipe: str) -> float:
    """Runs `count` quantize CLIs at once; returns the seconds until the last one ended."""
    started = time.monotonic()
    procs = []
    for i in range(count):
        dst = out / f"out-{i}.safetensors"
        dst.unlink(missing_ok=True)
        args = [*e2e_bench._quantize_cmd(str(src), str(dst), address, recipe), "--overwrite"]
        # Busy answers are retried (client/retry.py): the server may ask them to wait.
        procs.append(subprocess.Popen([*args, "--retries", "50"], stderr=subprocess.PIPE))
    for proc in procs:
        _, err = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"client failed: {err.decode()[-2000:]}")
    return time.monotonic() - started


def _option(text: str) -> list:
    name, _, value = text.partition("=")
    return [name, int(value) if value.lstrip("-").isdigit() else value]


def run_limit(args: argparse.Namespace, src: pathlib.Path, work: pathlib.Path, limit_mib: int):
    port = e2e_bench._free_port()
    address = f"127.0.0.1:{port}"
    flags = ["--max-inflight-bytes", str(limit_mib * MiB), "--workers", str(args.workers)]
    qmill = e2e_bench.QMILL
    if args.grpc_option or args.keep_freed:
        options = json.dumps([_option(o) for o in args.grpc_option])
        keep = "1" if args.keep_freed else "0"
        qmill = [sys.executable, "-c", _LAUNCHER, options, keep]
    server = subprocess.Popen(
        [*qmill, "serve", "--port", str(port), *flags, *args.serve_arg],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        e2e_bench._wait_until_up(address)
        row = {"limit_mib": limit_mib, "idle_mb": e2e_bench.peak_rss_mb(server.pid)}
        row["cold_seconds"] = _clients(src, work, address, args.clients, args.recipe)
        row["cold_mb"] = e2e_bench.peak_rss_mb(server.pid)
        row["rss_after_cold_mb"] = _rss_mb(server.pid)
        row["inflight_peak_mb"] = _inflight_peak_mb(address)
        e2e_bench.reset_peak_rss(server.pid)
        row["warm_seconds"] = _clients(src, work, address, args.clients, args.recipe)
        row["warm_mb"] = e2e_bench.peak_rss_mb(server.pid)
        return row
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limits-mib", default="40,64,128")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--tensor-mib", type=int, default=16)
    parser.add_argument("--tensors", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--recipe", default="int8")
    parser.add_argument("--serve-arg", action="append", default=[])
    parser.add_argument(
        "--keep-freed",
        action="store_true",
        help="server with proto/memory.py's malloc tuning (freed blocks kept for reuse)",
    )
    parser.add_argument(
        "--grpc-option",
        action="append",
        default=[],
        help="NAME=VALUE added to the server's gRPC options (e.g. grpc.http2.bdp_probe=0)",
    )
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="qmill-rss-") as tmp:
        work = pathlib.Path(tmp)
        src, nbytes = e2e_bench.make_checkpoint(
            work / "src.safetensors", args.tensors, args.tensor_mib
        )
        for limit in (int(v) for v in args.limits_mib.split(",")):
            row = run_limit(args, src, work, limit)
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "clients": args.clients,
        "checkpoint_mib": nbytes / MiB,
        "tensor_mib": args.tensor_mib,
        "workers": args.workers,
        "serve_args": args.serve_arg,
        "keep_freed_buffers": args.keep_freed,
        "grpc_options": args.grpc_option,
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        "rows": rows,
    }
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
