"""End-to-end: quantize a synthetic checkpoint through `qmill serve` vs raw gRPC byte streaming.

    python bench/e2e_bench.py [--gib 0.5] [--tensor-mib 32] [--recipes int8,int4,nf4,fp8]
                              [--replicas 1,3] [--streams 1,2,4] [--repeat 2]
                              [--server-platforms default,cpu] [--server-log PATH]
                              [--json bench/results/e2e.json]

Both runs send the same bytes over loopback in 4 MiB messages, in the same session on the same
machine, each against a server in its own process:
- baseline: a bare grpc server (sync API, generic handler) that only counts the bytes it receives;
  measured before and after the qmill runs (`--repeat` times each) and once before each case,
  the best is the baseline;
- qmill: `qmill quantize SRC -o DST --server` (client process) against `qmill serve` (server
  process): read, send, quantize, stream back, write. With `--replicas N`, N server processes
  and `--server a,b,c` (client/fanout.py spreads the tensors over them). The servers of one
  replica count are started once and serve every recipe; each recipe first warms every server's
  compile cache with one tensor (as a long-running server's is), then runs `--repeat` times.
  With `--streams N`, the client opens N concurrent QuantizeParams streams to each server
  (`qmill quantize --streams N`). With `--server-platforms default,cpu` every case runs against
  servers on each platform in turn (on a GPU machine: the GPU, then JAX_PLATFORMS=cpu), the
  same raw baseline for all.
Reported per (replica count, recipe, streams): the best throughput, its ratio to the raw
baseline, peak RSS of the qmill client (its own VmHWM, read as it exits: ru_maxrss from wait4
would include this bench process's, which Linux carries across fork and exec) and of the largest
server process (VmHWM, reset through /proc/PID/clear_refs before each run), and the CPU seconds
(user + system) the client and all servers used in each run: on a shared machine those move less
than wall-clock throughput. On one machine the replicas share its cores (and
accelerator): N > 1 shows the fan-out's overhead and the CPU-bound speed-up at most, not a
cluster's scaling.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
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
from collections.abc import Iterator, Sequence

import grpc
import numpy as np
import safetensors.numpy

from qmill.checkpoints.formats.safetensors import header as safetensors_header

CHUNK = 4 * 1024 * 1024
RAW_METHOD = "/bench.Raw/Push"
QMILL = [sys.executable, "-m", "qmill.cli"]
# The CLI in a process that writes its own peak RSS (VmHWM) to $QMILL_BENCH_HWM as it exits.
CLIENT = r"""
import atexit, os, sys
from qmill.cli import main as cli
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            open(os.environ["QMILL_BENCH_HWM"], "w").write(line.split()[1])
atexit.register(hwm)
sys.exit(cli.main(sys.argv[1:]))
"""

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
    path: pathlib.Path, count: int, tensor_mib: int, *, seed: int = 0
) -> tuple[pathlib.Path, int]:
    """A safetensors file of `count` f32 (out, in) weights of ~tensor_mib each; (path, bytes).

    The header (qmill's own encoder) and then the tensors one at a time, so making a
    checkpoint larger than memory needs only one tensor in memory.
    """
    side = int((tensor_mib * 2**20 / 4) ** 0.5)
    nbytes = side * side * 4
    header = {
        f"layers.{i}.weight": {
            "dtype": "F32",
            "shape": [side, side],
            "data_offsets": [i * nbytes, (i + 1) * nbytes],
        }
        for i in range(count)
    }
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(safetensors_header.encode_header(header, {}))
        for _ in range(count):
            f.write(rng.standard_normal((side, side), np.float32).tobytes())
    return path, count * nbytes


def peak_rss_mb(pid: int) -> float:
    """VmHWM of a process (peak resident set since start or since reset_peak_rss)."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss(pid: int) -> None:
    """Resets VmHWM to the current RSS (Linux: writing 5 to /proc/PID/clear_refs)."""
    pathlib.Path(f"/proc/{pid}/clear_refs").write_text("5")


def raw_baseline(path: pathlib.Path) -> tuple[float, float]:
    """(seconds, CPU seconds of sender and server together) to push the tensors' bytes (read
    from the file) to a counting server."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", RAW_SERVER, str(port)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        with grpc.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 8 << 20)]
        ) as channel:
            push = channel.stream_unary(RAW_METHOD)
            with safetensors.safe_open(str(path), "np") as f:
                keys = list(f.keys())

                def chunks() -> Iterator[bytes]:
                    for key in keys:
                        data = f.get_tensor(key).view(np.uint8).reshape(-1)
                        for offset in range(0, data.size, CHUNK):
                            yield data[offset : offset + CHUNK].tobytes()

                cpu = cpu_seconds(proc.pid) + _own_cpu_seconds()
                start = time.perf_counter()
                push(chunks(), timeout=600)
                seconds = time.perf_counter() - start
                return seconds, cpu_seconds(proc.pid) + _own_cpu_seconds() - cpu
    finally:
        proc.terminate()
        proc.wait()


def _own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # all of this process's threads
    return usage.ru_utime + usage.ru_stime


def _wait_until_up(address: str, server: subprocess.Popen | None = None) -> None:
    """Waits until `qmill capabilities` answers; fails at once if `server` has exited."""
    for _ in range(240):
        if server is not None and server.poll() is not None:
            raise RuntimeError(f"qmill serve for {address} exited with code {server.returncode}")
        caps = [*QMILL, "capabilities", "--server", address]
        if subprocess.run(caps, capture_output=True).returncode == 0:
            return
        time.sleep(0.5)
    raise RuntimeError(f"qmill serve at {address} did not come up")


def server_env(platform: str = "default") -> dict[str, str]:
    """The environment of a `qmill serve` on `platform`: "default" (jax picks: the GPU where
    there is one) or a JAX_PLATFORMS value ("cpu"); GPU memory grown on use, as deploy/ runs it."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    env.pop("JAX_PLATFORMS", None)
    if platform != "default":
        env["JAX_PLATFORMS"] = platform
    return env


@contextlib.contextmanager
def qmill_servers(
    count: int,
    platform: str = "default",
    log: str | None = None,
    cpus: str | None = None,
    extra: Sequence[str] = (),
) -> Iterator[list[tuple[int, str]]]:
    """`count` local `qmill serve` processes on `platform` (server_env), once all answer;
    yields (pid, address) each. Their output goes to the file `log` (appended), else nowhere;
    `cpus` given, they are pinned to that taskset list; `extra`: more `qmill serve` flags."""
    started = []
    out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
    try:
        for _ in range(count):
            port = _free_port()
            command = [*QMILL, "serve", "--port", str(port), *extra]
            server = subprocess.Popen(
                ["taskset", "-c", cpus, *command] if cpus else command,
                stdout=out,
                stderr=out,
                env=server_env(platform),
            )
            started.append((server, f"127.0.0.1:{port}"))
        for server, address in started:
            _wait_until_up(address, server)
        yield [(server.pid, address) for server, address in started]
    finally:
        for server, _ in started:
            server.terminate()
            server.wait()
        if log:
            out.close()


def _quantize_args(src: str, dst: str, server: str, recipe: str, streams: int = 1) -> list[str]:
    args = ["quantize", src, "-o", dst, "--server", server, "--recipe", recipe, "-q"]
    # Only when asked: a tree from before --streams existed can still be measured.
    return args + (["--streams", str(streams)] if streams != 1 else [])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used so far (/proc/PID/stat)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _quantize_cmd(src: str, dst: str, server: str, recipe: str) -> list[str]:
    return [*QMILL, *_quantize_args(src, dst, server, recipe)]


def warm(path: pathlib.Path, servers: list[tuple[int, str]], recipe: str) -> None:
    """Quantizes the checkpoint's first tensor on every server (fills its compile cache)."""
    with tempfile.TemporaryDirectory() as tmp:
        with safetensors.safe_open(str(path), "np") as f:
            key = next(iter(f.keys()))
            safetensors.numpy.save_file({key: f.get_tensor(key)}, f"{tmp}/w.safetensors")
        for i, (_, address) in enumerate(servers):
            cmd = _quantize_cmd(f"{tmp}/w.safetensors", f"{tmp}/o{i}.safetensors", address, recipe)
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def quantize_once(
    path: pathlib.Path,
    out: pathlib.Path,
    servers: list[tuple[int, str]],
    recipe: str,
    streams: int = 1,
) -> tuple[float, float, float, float, float]:
    """(seconds, client peak RSS MB, largest server peak RSS MB during the run, client CPU
    seconds, servers' CPU seconds) of one `qmill quantize` through `servers` (`--server a,b,c`
    when more than one)."""
    for pid, _ in servers:
        reset_peak_rss(pid)
    target = ",".join(address for _, address in servers)
    server_cpu = sum(cpu_seconds(pid) for pid, _ in servers)
    start = time.perf_counter()
    hwm_file = out.with_name("client-hwm")
    args = _quantize_args(str(path), str(out), target, recipe, streams)
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, *args], env={**os.environ, "QMILL_BENCH_HWM": str(hwm_file)}
    )
    _, status, usage = os.wait4(client.pid, 0)
    seconds = time.perf_counter() - start
    server_cpu = sum(cpu_seconds(pid) for pid, _ in servers) - server_cpu
    client_cpu = usage.ru_utime + usage.ru_stime
    client.returncode = os.waitstatus_to_exitcode(status)
    if client.returncode != 0:
        raise RuntimeError(f"qmill quantize failed with exit code {client.returncode}")
    out.unlink()
    server_mb = max(peak_rss_mb(pid) for pid, _ in servers)
    client_mb = int(hwm_file.read_text()) / 1024
    hwm_file.unlink()
    return seconds, client_mb, server_mb, client_cpu, server_cpu


def environment() -> dict[str, str]:
    """Machine and versions, for the results file."""
    versions = {name: importlib.metadata.version(name) for name in ("jax", "grpcio", "numpy")}
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "machine": f"{cpu}, {platform.machine()}, {os.cpu_count()} cores, {mem_gib:.0f} GiB",
        "python": platform.python_version(),
        **versions,
        "date": time.strftime("%Y-%m-%d"),
    }


def _case(
    path: pathlib.Path,
    mb: float,
    servers: list[tuple[int, str]],
    recipe: str,
    streams: int,
    repeat: int,
) -> dict[str, object]:
    """One (replica count, recipe, streams) case: `repeat` runs, the best counts."""
    out = path.with_name("out.safetensors")
    tries = [quantize_once(path, out, servers, recipe, streams) for _ in range(repeat)]
    seconds = min(t[0] for t in tries)
    return {
        "replicas": len(servers),
        "streams": streams,
        "recipe": recipe,
        "seconds": [round(t[0], 2) for t in tries],
        "qmill_MB_per_s": round(mb / seconds, 1),
        "client_peak_rss_MB": round(max(t[1] for t in tries), 1),
        "server_peak_rss_MB": round(max(t[2] for t in tries), 1),
        "client_cpu_s": [round(t[3], 2) for t in tries],
        "server_cpu_s": [round(t[4], 2) for t in tries],
    }


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=0.5, help="checkpoint size (default 0.5)")
    parser.add_argument("--tensor-mib", type=int, default=32)
    # Comma-separated lists, split here (argparse converts the defaults too); each list's
    # values are run in turn.
    parser.add_argument("--recipes", type=_names, default="int8", help="presets, comma-separated")
    parser.add_argument(
        "--replicas",
        type=_counts,
        default="1",
        help="local `qmill serve` processes to spread the checkpoint over; a list (1,3) runs "
        "each count in turn against the same baseline (default 1)",
    )
    parser.add_argument(
        "--streams",
        type=_counts,
        default="1",
        help="concurrent QuantizeParams streams per server (`qmill quantize --streams`); a list "
        "(1,2,4) runs each in turn (default 1)",
    )
    parser.add_argument(
        "--server-platforms",
        type=_names,
        default="default",
        help="where the servers run JAX, a list run in turn against the same baseline: default "
        "(the GPU where jax has one), cpu (JAX_PLATFORMS=cpu) (default: default)",
    )
    parser.add_argument("--server-log", metavar="PATH", help="append the servers' output here")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each case; best counts")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    parser.add_argument(
        "--workdir", default=None, help="where to put the checkpoints (default: a temp dir)"
    )
    args = parser.parse_args()
    if min(args.replicas) < 1 or min(args.streams) < 1:
        parser.error("--replicas, --streams: counts must be >= 1")
    return args


def _counts(text: str) -> list[int]:
    """'1,3' as [1, 3]."""
    return [int(n) for n in text.split(",")]


def _names(text: str) -> list[str]:
    """'int8, int4' as ['int8', 'int4'] (blanks dropped)."""
    return [name.strip() for name in text.split(",") if name.strip()]


def print_and_save(result: dict, path: str | None) -> None:
    """Prints the results as JSON, and writes them to `path` too when given."""
    text = json.dumps(result, indent=1)
    print(text)
    if path:
        pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(path).write_text(text + "\n")


def main() -> int:
    args = _parse_args()
    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="qmill-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    runs = []
    try:
        count = max(1, round(args.gib * 1024 / args.tensor_mib))
        path, nbytes = make_checkpoint(work / "synthetic.safetensors", count, args.tensor_mib)
        mb = nbytes / 1e6
        raw = [raw_baseline(path) for _ in range(args.repeat)]
        for platform in args.server_platforms:
            for n in args.replicas:
                with qmill_servers(n, platform, args.server_log) as servers:
                    for recipe in args.recipes:
                        warm(path, servers, recipe)
                        for streams in args.streams:
                            # Interleaved: the machine may be shared, and its load moves.
                            raw.append(raw_baseline(path))
                            run = _case(path, mb, servers, recipe, streams, args.repeat)
                            runs.append({"server_platform": platform, **run})
                            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
        raw += [raw_baseline(path) for _ in range(args.repeat)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    raw_mb_s = mb / min(seconds for seconds, _ in raw)
    for run in runs:  # ratio = qmill throughput / raw gRPC throughput of the same session
        run["ratio"] = round(run["qmill_MB_per_s"] / raw_mb_s, 3)
    result = {
        **environment(),
        "checkpoint_MB": round(mb, 1),
        "tensors": count,
        "largest_tensor_MB": round(nbytes / count / 1e6, 1),
        "raw_grpc_MB_per_s": round(raw_mb_s, 1),
        "raw_grpc_MB_per_s_all": [round(mb / s, 1) for s, _ in raw],
        # Sender + server CPU seconds of each raw run (compare with client_cpu_s + server_cpu_s).
        "raw_grpc_cpu_s_all": [round(cpu, 2) for _, cpu in raw],
        "rss_target_MB": round(3 * nbytes / count / 1e6 + 500, 1),
        # One entry per (replica count, recipe, streams).
        "runs": runs,
    }
    print_and_save(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
