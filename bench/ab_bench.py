"""Whole commands timed round robin: two trees of qmill (before / after a change) and a floor.

    python bench/ab_bench.py --runs 5 --json bench/results/ab.json \\
        --before /tmp/before-pkg -- quantize /tmp/llama-1g -o {out} --recipe W4A16 -q

Each run is a fresh `python -m qmill.cli ARGS` (`{out}` becomes a fresh output path, removed
after the run): "after" is this checkout, "before" the same with PYTHONPATH=BEFORE, a directory
holding a `qmill` entry (a symlink to another checkout's root) that wins over the editable
install. `--floor` adds `cp -r SRC {out}` for SRC. Order per round: before, after, floor, so
load changes hit all alike. Wall time from spawn to exit, CPU (user + system) and peak RSS from
os.wait4. The table gives each command's median and best, and the ratio of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import time


def _run(argv: list[str], env: dict[str, str]) -> dict[str, float]:
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {proc.stderr.read().decode()[-2000:]}")
    proc.stderr.close()
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mb": usage.ru_maxrss / 1024,
    }


def _commands(args: argparse.Namespace, out: pathlib.Path) -> dict[str, tuple[list, dict]]:
    qmill = [arg.replace("{out}", str(out)) for arg in args.args]
    env = dict(os.environ)
    commands = {}
    if args.before:
        commands["before"] = (
            [sys.executable, "-m", "qmill.cli", *qmill],
            env | {"PYTHONPATH": str(args.before)},
        )
    commands["after"] = ([sys.executable, "-m", "qmill.cli", *qmill], env)
    if args.floor:
        commands["cp -r"] = (["cp", "-r", str(args.floor), str(out)], env)
    return commands


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--before", type=pathlib.Path)
    parser.add_argument("--floor", type=pathlib.Path)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("/tmp/ab-bench-out"))
    parser.add_argument("--json", type=pathlib.Path)
    parser.add_argument("args", nargs="+")
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.runs):
        for name, (argv, env) in _commands(args, args.out).items():
            shutil.rmtree(args.out, ignore_errors=True)
            results.setdefault(name, []).append(_run(argv, env))
            shutil.rmtree(args.out, ignore_errors=True)
    summary = {
        name: {
            "median_wall_s": statistics.median(r["wall_s"] for r in runs),
            "best_wall_s": min(r["wall_s"] for r in runs),
            "median_cpu_s": statistics.median(r["cpu_s"] for r in runs),
            "max_peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        }
        for name, runs in results.items()
    }
    print(f"{'command':8} {'median s':>9} {'best s':>8} {'cpu s':>7} {'peak MB':>8}")
    for name, s in summary.items():
        print(
            f"{name:8} {s['median_wall_s']:9.2f} {s['best_wall_s']:8.2f} "
            f"{s['median_cpu_s']:7.2f} {s['max_peak_rss_mb']:8.0f}"
        )
    if "cp -r" in summary:
        floor = summary["cp -r"]["median_wall_s"]
        for name in ("before", "after"):
            if name in summary:
                print(f"{name} / cp -r (medians): {summary[name]['median_wall_s'] / floor:.2f}x")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": args.args,
                    "machine": platform.platform(),
                    "cpus": os.cpu_count(),
                    "load_average": os.getloadavg(),
                    "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "runs": results,
                    "summary": summary,
                },
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
