"""`qmill quantize` of a Hugging Face folder against `cp -r` of it, whole commands (issue 27:
within 4x), with XLA's compilation cache cold and warm.

    python bench/cp_ratio_bench.py --folder /tmp/llama-1g [--runs 5] [--recipe W4A16]
        [--before DIR [--before-cache off|warm]] [--json OUT.json]

Each round runs, in this order: `cp -r`; qmill with a cache directory emptied just before
(cold); qmill with a cache it filled in an untimed first run (warm); and, with --before DIR,
the qmill whose `qmill/` package tree is in DIR (put first on PYTHONPATH; its cache off, as
before the cache existed, or with `--before-cache warm` the warm case's, for a tree that has
one). Wall time from spawn to exit, the child's CPU time (user + system) and peak RSS
(os.wait4). Outputs go to a scratch folder next to --out and are deleted after each run.
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

import ct_bench  # bench/ is the script's directory


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """(wall s, CPU s, peak RSS MB) of a child run to completion; raises if it fails."""
    start = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"{command} failed: {child.stderr.read().decode()[-2000:]}")
    child.stderr.close()
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def cases(args: argparse.Namespace, out: pathlib.Path) -> dict[str, tuple[list[str], dict]]:
    qmill = [sys.executable, "-m", "qmill.cli", "quantize", str(args.folder), "-o", str(out)]
    qmill += ["--recipe", args.recipe, "--format", "compressed-tensors", "-q"]
    warm_dir, cold_dir = args.out / "xla-warm", args.out / "xla-cold"
    result = {
        "cp -r": (["cp", "-r", str(args.folder), str(out)], dict(os.environ)),
        "qmill, cold cache": (qmill, {**os.environ, "QMILL_COMPILATION_CACHE": str(cold_dir)}),
        "qmill, warm cache": (qmill, {**os.environ, "QMILL_COMPILATION_CACHE": str(warm_dir)}),
    }
    if args.before:
        path = os.pathsep.join(filter(None, [str(args.before), os.environ.get("PYTHONPATH")]))
        cache = str(warm_dir) if args.before_cache == "warm" else "off"
        env = {**os.environ, "PYTHONPATH": path, "QMILL_COMPILATION_CACHE": cache}
        result["qmill before"] = (qmill, env)
    return result


def main() -> None:
    parser = ct_bench.folder_parser(__doc__, "/tmp/cp-ratio-bench", runs=5)
    parser.add_argument("--recipe", default="W4A16")
    parser.add_argument("--before", type=pathlib.Path, help="a tree holding qmill/ to compare")
    parser.add_argument("--before-cache", choices=("off", "warm"), default="off")
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "output"
    shutil.rmtree(out, ignore_errors=True)
    table = cases(args, out)
    timed(*table["qmill, warm cache"])  # fills the warm cache (untimed)
    shutil.rmtree(out)
    rows = []
    for run in range(args.runs):
        for name, (command, env) in table.items():
            if name == "qmill, cold cache":
                shutil.rmtree(args.out / "xla-cold", ignore_errors=True)
            wall, cpu, rss = timed(command, env)
            shutil.rmtree(out)
            rows.append({"case": name, "run": run, "wall_s": round(wall, 3)})
            rows[-1].update(cpu_s=round(cpu, 3), peak_rss_mb=round(rss))
            rows[-1].update(load_1min=round(os.getloadavg()[0], 2))
            print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for name in table:
        walls = [r["wall_s"] for r in rows if r["case"] == name]
        cpus = [r["cpu_s"] for r in rows if r["case"] == name]
        summary[name] = {
            "wall_median_s": statistics.median(walls),
            "wall_min_s": min(walls),
            "cpu_median_s": statistics.median(cpus),
            "peak_rss_max_mb": max(r["peak_rss_mb"] for r in rows if r["case"] == name),
        }
    cp = summary["cp -r"]
    for name, row in summary.items():
        row["x_cp_median"] = round(row["wall_median_s"] / cp["wall_median_s"], 2)
        row["x_cp_min"] = round(row["wall_min_s"] / cp["wall_min_s"], 2)
        wall = f"{row['wall_median_s']:.2f} / {row['wall_min_s']:.2f}"
        ratio = f"{row['x_cp_median']} / {row['x_cp_min']}"
        print(f"| {name} | {wall} | {row['cpu_median_s']:.2f} | {ratio} |")
    machine = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average_end": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    print(machine)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "summary": summary, "runs": rows}))


if __name__ == "__main__":
    main()
