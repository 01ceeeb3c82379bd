"""How long `qmill` takes to start: whole commands, as a user runs them.

    python bench/startup_bench.py [--runs 7] [--json bench/results/startup.json]

Each command runs `--runs` times in a fresh process (the installed `qmill` console script of this
environment, cwd a scratch copy of examples/); the table gives the median and the fastest wall
time, and which of jax, grpc and orbax the command's process imported (`python -X importtime`
of the same command, so the answer is the process's own, not a guess). Columns: median and
fastest wall time, and the median CPU time (user + system): on a loaded machine the wall time
stretches, the CPU time much less, and start-up is one thread, so the CPU time is close to what
a quiet machine's wall clock shows.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEAVY = ("jax", "grpc", "orbax")
COMMANDS = {
    "--version": ["--version"],
    "--help": ["--help"],
    "quantize --help": ["quantize", "--help"],
    "inspect (quick-start model)": ["inspect", "examples/tiny-mlp"],
    "quick start (quantize, in-process)": [
        "quantize", "examples/tiny-mlp", "-o", "tiny-mlp-int8", "--recipe", "int8", "--overwrite",
    ],
}  # fmt: skip


def _qmill() -> list[str]:
    exe = shutil.which("qmill", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "qmill.cli"]


def _time(args: list[str], cwd: pathlib.Path, runs: int) -> tuple[list[float], list[float]]:
    """Wall and CPU (user + system) seconds of each run."""
    walls, cpus = [], []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run([*_qmill(), *args], cwd=cwd, check=True, capture_output=True)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return walls, cpus


def _imported(args: list[str], cwd: pathlib.Path) -> list[str]:
    """Which of HEAVY the command's process imported (its -X importtime lines)."""
    code = "import sys; from qmill.cli import main; sys.exit(main.main())"
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    )
    names = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()}
    return [h for h in HEAVY if h in names]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        cwd = pathlib.Path(scratch)
        shutil.copytree(ROOT / "examples", cwd / "examples")
        for name, command in COMMANDS.items():
            walls, cpus = _time(command, cwd, args.runs)
            imported = _imported(command, cwd)
            row = {
                "command": name,
                "median_s": round(statistics.median(walls), 3),
                "min_s": round(min(walls), 3),
                "cpu_median_s": round(statistics.median(cpus), 3),
                "imports": imported,
            }
            results.append(row)
            print(
                f"| {name} | {row['median_s']:.2f} | {row['min_s']:.2f} | "
                f"{row['cpu_median_s']:.2f} | {', '.join(imported) or '-'} |",
                flush=True,
            )
    machine = {
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    print(machine)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"machine": machine, "results": results}))


if __name__ == "__main__":
    main()
