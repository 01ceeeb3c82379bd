"""Calibration batches/s on the server's device: a client's program run remotely vs locally.

    python bench/calibrate_bench.py [--batches 64] [--batch-size 64,256] [--repeat 3]
                                    [--json bench/results/calibrate.json]

The model is examples/digits_cnn.py (a Linen CNN no registry knows) under w8a8 static-range rules,
its calibrate program built once per batch size. In the same process and session, each case runs
`--repeat` times, best kept:
- local: the artifact deserialized and run in-process (programs.load + calibrate_step), batch after
  batch on this machine's default device: the floor for running the same program;
- remote program: Client.calibrate with the program against `qmill serve` on 127.0.0.1 (a child
  process), params uploaded once: stream batches, the server runs the artifact, stats come back;
Reported: batches/s and examples/s per case and the ratio of remote to local. The first
call of each case compiles; it is run once before timing (as a long-running server's cache is).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import pathlib
import platform
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import jax
import numpy as np
import safetensors.numpy

import qmill.engine as qe
from qmill.client import Client
from qmill.engine.programs import build as program_build
from qmill.engine.programs import program as programs
from qmill.proto.v1 import qmill_pb2 as pb

ROOT = pathlib.Path(__file__).resolve().parents[1]
W8A8 = [qe.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]


def _example():
    spec = importlib.util.spec_from_file_location("digits_cnn", ROOT / "examples" / "digits_cnn.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _server(data_dir: str) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "qmill.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--data-dir", data_dir],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with Client(address, timeout=5) as c:
                    c.capabilities()
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("qmill serve did not start") from None
                time.sleep(0.5)
        yield address
    finally:
        proc.terminate()
        proc.wait(30)


def _best(fn: Callable[[], None], repeat: int) -> float:
    fn()  # compiles (a long-running server has its cache warm)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _cases(address: str, batch_size: int, n: int, repeat: int) -> dict[str, float]:
    example = _example()
    x = np.random.default_rng(0).uniform(size=(n * batch_size, 8, 8, 1)).astype(np.float32)
    batches = np.split(x, n)
    params = example.init_params()
    data, flat = program_build.calibration_program(
        example.DigitsCnn(), W8A8, batches[0], params=params
    )
    program = programs.load(data)
    tree = programs.tree_from_flat(program.params, flat, "params")
    step = programs.calibrate_step(program)

    def local() -> None:
        stats = programs.zero_stats(program)
        for b in batches:
            stats = step(tree, stats, *programs.check_inputs(program, [b]))
        jax.block_until_ready(stats)

    with Client(address) as client:
        upload = client.upload(safetensors.numpy.save(flat)).upload_id
        start = pb.CalibrateStart(program=data, params_upload_id=upload)
        seconds = {
            "local": _best(local, repeat),
            "remote_program": _best(lambda: client.calibrate(start, batches), repeat),
        }
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=64)
    parser.add_argument("--batch-size", default="64,256")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp, _server(tmp) as address:
        for bs in (int(b) for b in args.batch_size.split(",")):
            seconds = _cases(address, bs, args.batches, args.repeat)
            row = {"batch_size": bs, "batches": args.batches}
            for case, s in seconds.items():
                row[f"{case}_batches_per_s"] = args.batches / s
                row[f"{case}_examples_per_s"] = args.batches * bs / s
                row[f"{case}_vs_local"] = seconds["local"] / s
            rows.append(row)
            print(
                f"batch {bs}: local {args.batches / seconds['local']:.1f} batches/s; "
                f"remote program {row['remote_program_batches_per_s']:.1f} "
                f"({row['remote_program_vs_local']:.2f}× local)"
            )
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "device": str(jax.devices()[0]),
        "date": time.strftime("%Y-%m-%d"),
        "jax": jax.__version__,
        "rows": rows,
    }
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
