"""`qmill quantize --format compressed-tensors` against llm-compressor's model_free_ptq, as whole
commands on the same Hugging Face folder (issue 24).

    python bench/ct_bench.py --folder /tmp/llama-1g [--runs 2] [--json out.json]

Makes the folder first when it is missing: a Llama-architecture model in bf16 written by
transformers from a config (random weights, ~1.07 GB, two shards and an index). For each scheme
(W4A16, FP8_DYNAMIC) it times, round robin, `runs` times each:
  - qmill embedded:   `qmill quantize SRC -o OUT --recipe SCHEME -q`
  - qmill via server: the same with `--server` to a `qmill serve` started beforehand on loopback
                      (its start is not timed; its RSS is reported beside the client's)
  - cp -r:            a copy of the folder (the floor; its row is not compared)
  - model_free_ptq:   a `python -c` calling model_free_ptq(SRC, OUT, scheme, ignore, max_workers)
                      with max_workers 1 and 2, ignore = qmill's defaults (lm_head, embeddings)
Wall time is the child's, from spawn to exit (imports included: what a user waits for); peak
RSS is the child's ru_maxrss (os.wait4). Every output is checked tensor for tensor against the
first model_free_ptq output of its scheme, so the table compares equal work.
Needs the interop extra (torch, transformers, llmcompressor).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

SCHEMES = ("W4A16", "FP8_DYNAMIC")
IGNORE = ["lm_head", "model.embed_tokens"]


def make_folder(folder: pathlib.Path) -> None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from tests import lm_folder

    lm_folder.write_llama(
        folder,
        save={"max_shard_size": "600MB"},
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )


def timed(command: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of a child process run to completion; raises if it fails.

    The RSS comes from /usr/bin/time: a child forked from this (large, torch-importing) process
    would inherit its high-water mark in ru_maxrss."""
    start = time.perf_counter()
    done = subprocess.run(
        ["/usr/bin/time", "-f", "maxrss_kb=%M", *command],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    seconds = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{command} failed: {done.stderr[-2000:]}")
    line = [x for x in done.stderr.splitlines() if x.startswith("maxrss_kb=")][-1]
    return seconds, int(line.split("=")[1]) * 1024


def qmill() -> list[str]:
    exe = shutil.which("qmill", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "qmill.cli"]


def peer(src: pathlib.Path, out: pathlib.Path, scheme: str, workers: int) -> list[str]:
    code = (
        "from llmcompressor import model_free_ptq; "
        f"model_free_ptq({str(src)!r}, {str(out)!r}, scheme={scheme!r}, ignore={IGNORE!r}, "
        f"max_workers={workers})"
    )
    return [sys.executable, "-c", code]


def same_tensors(a: pathlib.Path, b: pathlib.Path) -> bool:
    from safetensors.torch import load_file

    def load(folder: pathlib.Path) -> dict:
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    x, y = load(a), load(b)
    return sorted(x) == sorted(y) and all(
        x[k].dtype == y[k].dtype
        and x[k]
        .view(-1)
        .view(__import__("torch").uint8)
        .equal(y[k].view(-1).view(__import__("torch").uint8))
        for k in x
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cases(folder: pathlib.Path, scheme: str, port: int) -> dict[str, Any]:
    """Each case's command, given its output path."""

    def quantize(o: pathlib.Path) -> list[str]:
        return [*qmill(), "quantize", str(folder), "-o", str(o), "--recipe", scheme, "-q"]

    return {
        # The floor a quantizer is measured against (issue 27: within 4x of it).
        "cp -r": lambda o: ["cp", "-r", str(folder), str(o)],
        "model_free_ptq max_workers=1": lambda o: peer(folder, o, scheme, 1),
        "model_free_ptq max_workers=2": lambda o: peer(folder, o, scheme, 2),
        "qmill embedded": quantize,
        "qmill --server": lambda o: [*quantize(o), "--server", f"127.0.0.1:{port}"],
    }


def _run_case(
    name: str, command: Any, out: pathlib.Path, reference: pathlib.Path, server_pid: int
) -> dict[str, Any]:
    """One timed run of a case, compared with the reference output."""
    if name.startswith("model_free") and not reference.exists():
        out = reference
    # Each command starts with the previous one's dirty pages on disk: its writeback otherwise
    # lands in the next command's time (cp -r took 2.13 s right after model_free_ptq and the
    # server run, 0.34 s otherwise).
    os.sync()
    seconds, rss = timed(command(out))
    # A copy is not quantized: nothing to compare (None in the JSON).
    equal = None if name == "cp -r" else (out == reference or same_tensors(out, reference))
    row = {
        "case": name,
        "seconds": seconds,
        "peak_rss": rss,
        "equal_to_model_free_ptq": equal,
    }
    if name == "qmill --server":
        with open(f"/proc/{server_pid}/status") as f:
            hwm = next(line for line in f if line.startswith("VmHWM"))
        row["server_peak_rss"] = int(hwm.split()[1]) * 1024
    if out != reference:
        shutil.rmtree(out, ignore_errors=True)
    return row


def folder_parser(doc: str, out: str, runs: int) -> argparse.ArgumentParser:
    """The flags of a bench over a Hugging Face folder: --folder, --out (default `out`), --runs
    (default `runs`); `doc`: the bench's module docstring."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--folder", type=pathlib.Path, required=True)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path(out))
    parser.add_argument("--runs", type=int, default=runs)
    return parser


def main() -> None:
    parser = folder_parser(__doc__, "/tmp/ct-bench-out", runs=2)
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    if not args.folder.exists():
        make_folder(args.folder)
    size = sum(p.stat().st_size for p in args.folder.glob("*.safetensors"))
    print(f"folder {args.folder}: {size / 1e9:.2f} GB of safetensors", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = subprocess.Popen(
        [*qmill(), "serve", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    results: list[dict] = []
    try:
        while subprocess.run(
            [*qmill(), "capabilities", "--server", f"127.0.0.1:{port}"], capture_output=True
        ).returncode:
            time.sleep(0.5)
        for scheme in args.schemes.split(","):
            reference = args.out / f"peer-{scheme}"
            for run in range(args.runs):
                for name, command in _cases(args.folder, scheme, port).items():
                    out = args.out / f"{scheme}-{name.split()[0]}-{run}"
                    shutil.rmtree(out, ignore_errors=True)
                    case = _run_case(name, command, out, reference, server.pid)
                    row = {"scheme": scheme, "case": name, "run": run, **case}
                    results.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        server.kill()
        server.wait()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
