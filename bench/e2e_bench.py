"""End-to-end: quantize a synthetic checkpoint through `qmill serve` vs raw gRPC byte streaming.

    python bench/e2e_bench.py [--gib 1.0] [--tensor-mib 64] [--recipe int8] [--keep]

Both runs send the same bytes over loopback in 4 MiB messages, in the same session on the same
machine, each against a server in its own process:
- baseline: a bare grpc server (sync API, generic handler) that only counts the bytes it receives;
- qmill: `qmill quantize SRC -o DST --server` (client process) against `qmill serve` (server
  process): read, send, quantize, stream back, write.
Reported: throughput of each, their ratio (target >= 0.6), and peak RSS of the qmill client and
server processes (target <= 3x the largest tensor + 500 MB, independent of checkpoint size).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np
import safetensors.numpy

CHUNK = 4 * 1024 * 1024
RAW_METHOD = "/bench.Raw/Push"

RAW_SERVER = r"""
import sys, grpc
from concurrent import futures
def push(request_iterator, context):
    n = 0
    for chunk in request_iterator:
        n += len(chunk)
    return n.to_bytes(8, "little")
handler = grpc.method_handlers_generic_handler("bench.Raw", {
    "Push": grpc.stream_unary_rpc_method_handler(push)})
server = grpc.server(futures.ThreadPoolExecutor(4), options=[
    ("grpc.max_receive_message_length", 8 << 20)])
server.add_generic_rpc_handlers((handler,))
server.add_insecure_port("127.0.0.1:" + sys.argv[1])
server.start()
print("ready", flush=True)
server.wait_for_termination()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_checkpoint(
    directory: pathlib.Path, gib: float, tensor_mib: int
) -> tuple[pathlib.Path, int]:
    """A sharded-free single safetensors file of f32 (out, in) weights; returns (path, bytes)."""
    side = int((tensor_mib * 2**20 / 4) ** 0.5)
    count = max(1, round(gib * 1024 / tensor_mib))
    rng = np.random.default_rng(0)
    path = directory / "synthetic.safetensors"
    tensors = {
        f"layers.{i}.weight": rng.standard_normal((side, side), np.float32) for i in range(count)
    }
    safetensors.numpy.save_file(tensors, str(path))
    return path, sum(t.nbytes for t in tensors.values())


def _peak_rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def raw_baseline(path: pathlib.Path) -> float:
    """Seconds to push the tensors' bytes (read from the file) to a counting server."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", RAW_SERVER, str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        proc.stdout.readline()
        with grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 8 << 20)]
        ) as channel:
            push = channel.stream_unary(RAW_METHOD)
            with safetensors.safe_open(str(path), "np") as f:
                keys = list(f.keys())

                def chunks():
                    for key in keys:
                        data = f.get_tensor(key).view(np.uint8).reshape(-1)
                        for offset in range(0, data.size, CHUNK):
                            yield data[offset : offset + CHUNK].tobytes()

                start = time.perf_counter()
                push(chunks(), timeout=600)
                return time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait()


def qmill_run(path: pathlib.Path, out: pathlib.Path, recipe: str) -> tuple[float, float, float]:
    """(seconds, client peak RSS MB, server peak RSS MB) for one quantize through `qmill serve`."""
    port = _free_port()
    qmill = [sys.executable, "-m", "qmill.client.cli"]
    server = subprocess.Popen(
        [*qmill, "serve", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        for _ in range(240):
            if (
                subprocess.run(
                    [*qmill, "capabilities", "--server", f"127.0.0.1:{port}"], capture_output=True
                ).returncode
                == 0
            ):
                break
            time.sleep(0.5)
        # Warm the server's compile cache with one tensor of the same shape, as a long-running
        # server would be; the measured run then shows steady-state throughput.
        with tempfile.TemporaryDirectory() as tmp:
            with safetensors.safe_open(str(path), "np") as f:
                key = next(iter(f.keys()))
                safetensors.numpy.save_file({key: f.get_tensor(key)}, f"{tmp}/w.safetensors")
            subprocess.run(
                [
                    *qmill,
                    "quantize",
                    f"{tmp}/w.safetensors",
                    "-o",
                    f"{tmp}/o.safetensors",
                    "--server",
                    f"127.0.0.1:{port}",
                    "--recipe",
                    recipe,
                    "-q",
                ],
                check=True,
            )
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        start = time.perf_counter()
        subprocess.run(
            [
                *qmill,
                "quantize",
                str(path),
                "-o",
                str(out),
                "--server",
                f"127.0.0.1:{port}",
                "--recipe",
                recipe,
                "-q",
            ],
            check=True,
        )
        seconds = time.perf_counter() - start
        client_mb = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024
        return seconds, client_mb, _peak_rss_mb(server.pid)
    finally:
        server.terminate()
        server.wait()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--tensor-mib", type=int, default=64)
    parser.add_argument("--recipe", default="int8")
    parser.add_argument(
        "--workdir", default=None, help="where to put the checkpoints (default: a temp dir)"
    )
    args = parser.parse_args()
    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="qmill-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        path, nbytes = make_checkpoint(work, args.gib, args.tensor_mib)
        raw_s = raw_baseline(path)
        qmill_s, client_mb, server_mb = qmill_run(path, work / "out.safetensors", args.recipe)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mb = nbytes / 1e6
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "checkpoint_MB": round(mb, 1),
        "largest_tensor_MB": round(args.tensor_mib * 2**20 / 1e6, 1),
        "recipe": args.recipe,
        "raw_grpc_MB_per_s": round(mb / raw_s, 1),
        "qmill_MB_per_s": round(mb / qmill_s, 1),
        "ratio": round(raw_s / qmill_s, 3),
        "client_peak_rss_MB": round(client_mb, 1),
        "server_peak_rss_MB": round(server_mb, 1),
        "rss_target_MB": round(3 * args.tensor_mib * 2**20 / 1e6 + 500, 1),
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
