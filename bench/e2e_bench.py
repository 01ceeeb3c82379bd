"""End-to-end: quantize a synthetic checkpoint through `qmill serve` vs raw gRPC byte streaming.

    python bench/e2e_bench.py [--gib 1.0] [--tensor-mib 64] [--recipe int8] [--replicas 1,3]

Both runs send the same bytes over loopback in 4 MiB messages, in the same session on the same
machine, each against a server in its own process:
- baseline: a bare grpc server (sync API, generic handler) that only counts the bytes it receives;
- qmill: `qmill quantize SRC -o DST --server` (client process) against `qmill serve` (server
  process): read, send, quantize, stream back, write. With `--replicas N`, N server processes
  and `--server a,b,c` (client/fanout.py spreads the tensors over them); each count in
  `--replicas 1,3` is run in turn against the same baseline.
Reported: throughput of each, their ratio (target >= 0.6), and peak RSS of the qmill client and
the largest server process (target <= 3x the largest tensor + 500 MB, independent of checkpoint
size). On one machine the replicas share its cores (and accelerator): N > 1 shows the fan-out's
overhead and the CPU-bound speed-up at most, not a cluster's scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
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


def _start_server(qmill: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    server = subprocess.Popen(
        [*qmill, "serve", "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return server, f"127.0.0.1:{port}"


def _wait_until_up(qmill: list[str], address: str) -> None:
    for _ in range(240):
        caps = [*qmill, "capabilities", "--server", address]
        if subprocess.run(caps, capture_output=True).returncode == 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"qmill serve at {address} did not come up")


def _quantize_cmd(qmill: list[str], src: str, dst: str, server: str, recipe: str) -> list[str]:
    return [*qmill, "quantize", src, "-o", dst, "--server", server, "--recipe", recipe, "-q"]


def qmill_run(
    path: pathlib.Path, out: pathlib.Path, recipe: str, replicas: int = 1
) -> tuple[float, float, float]:
    """(seconds, client peak RSS MB, largest server peak RSS MB) for one quantize through
    `replicas` local `qmill serve` processes (`--server a,b,c` when more than one)."""
    qmill = [sys.executable, "-m", "qmill.client.cli"]
    started = [_start_server(qmill) for _ in range(replicas)]
    try:
        for _, address in started:
            _wait_until_up(qmill, address)
        # Warm every server's compile cache with one tensor of the same shape, as long-running
        # servers would be; the measured run then shows steady-state throughput.
        with tempfile.TemporaryDirectory() as tmp:
            with safetensors.safe_open(str(path), "np") as f:
                key = next(iter(f.keys()))
                safetensors.numpy.save_file({key: f.get_tensor(key)}, f"{tmp}/w.safetensors")
            for i, (_, address) in enumerate(started):
                warm = f"{tmp}/o{i}.safetensors"
                subprocess.run(
                    _quantize_cmd(qmill, f"{tmp}/w.safetensors", warm, address, recipe), check=True
                )
        target = ",".join(address for _, address in started)
        start = time.perf_counter()
        client = subprocess.Popen(_quantize_cmd(qmill, str(path), str(out), target, recipe))
        # wait4: this client's own peak RSS (RUSAGE_CHILDREN would mix in every earlier child).
        _, status, usage = os.wait4(client.pid, 0)
        seconds = time.perf_counter() - start
        client.returncode = os.waitstatus_to_exitcode(status)
        if client.returncode != 0:
            raise RuntimeError(f"qmill quantize failed with exit code {client.returncode}")
        server_mb = max(_peak_rss_mb(server.pid) for server, _ in started)
        return seconds, usage.ru_maxrss / 1024, server_mb
    finally:
        for server, _ in started:
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
        "--replicas",
        default="1",
        help="local `qmill serve` processes to spread the checkpoint over; a list (1,3) runs "
        "each count in turn against the same baseline (default 1)",
    )
    parser.add_argument(
        "--workdir", default=None, help="where to put the checkpoints (default: a temp dir)"
    )
    args = parser.parse_args()
    counts = [int(n) for n in args.replicas.split(",")]
    if min(counts) < 1:
        parser.error("--replicas: counts must be >= 1")
    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="qmill-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    runs = []
    try:
        path, nbytes = make_checkpoint(work, args.gib, args.tensor_mib)
        raw_s = raw_baseline(path)
        mb = nbytes / 1e6
        for n in counts:
            out = work / f"out-{n}.safetensors"
            qmill_s, client_mb, server_mb = qmill_run(path, out, args.recipe, n)
            out.unlink()
            runs.append(
                {
                    "replicas": n,
                    "qmill_MB_per_s": round(mb / qmill_s, 1),
                    "ratio": round(raw_s / qmill_s, 3),
                    "client_peak_rss_MB": round(client_mb, 1),
                    "server_peak_rss_MB": round(server_mb, 1),
                }
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "checkpoint_MB": round(mb, 1),
        "largest_tensor_MB": round(args.tensor_mib * 2**20 / 1e6, 1),
        "recipe": args.recipe,
        "raw_grpc_MB_per_s": round(mb / raw_s, 1),
        "rss_target_MB": round(3 * args.tensor_mib * 2**20 / 1e6 + 500, 1),
        # One entry per replica count; ratio = qmill throughput / raw gRPC throughput.
        "runs": runs,
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
