"""The figures of one bench/gpu/run_all.sh run in one small JSON: python summarize.py OUT_DIR.

Reads what the steps wrote in OUT_DIR (any may be missing: its step failed or timed out) and
writes OUT_DIR/summary.json:
- parity: cases where qmill differs from the CPU fixtures on this device, split into those
  allowed to (mx formats' `log`, numerics) and the others (goal 0; `rms` sums take the CPU's
  order since issue 37);
- engine: the issue-2 targets on the device and each case's `bytes` / `leaf` figures;
- e2e: MB/s per (platform, recipe), the ratio to raw gRPC, and default (GPU) / cpu;
- flow: issue 25's steps per server platform and default (GPU) / cpu per step.
"""

from __future__ import annotations

import json
import pathlib
import sys


def _load(path: pathlib.Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _allowed(case: dict) -> bool:
    return case["qtype"].startswith("mx")


def parity(doc: dict) -> dict:
    differ = [c for c in doc["cases"] if c["qmill_vs_cpu"]]
    return {
        "device": doc["device"],
        **doc["summary"],
        "qmill_vs_cpu_allowed (mx)": [c["id"] for c in differ if _allowed(c)],
        "qmill_vs_cpu_unexpected": [
            {k: c[k] for k in ("id", "qtype", "dtype", "method", "detail")}
            for c in differ
            if not _allowed(c)
        ],
    }


def engine(doc: dict) -> dict:
    rows = {
        f"{r['dtype']} {r['case']} {r['path']}": [round(r["ms"], 3), round(r["pct_jitted_copy"], 1)]
        for r in doc["results"]
        if r["path"] in ("quantize", "bytes", "leaf")
    }
    base = doc["baselines"]
    return {
        "device": doc.get("device"),
        "size": doc.get("size"),
        "jitted_copy_GBps": {k: round(v["jitted_copy_gbs"], 1) for k, v in base.items()},
        "ms, % of jitted copy": rows,
        "targets": [
            f"{t['path']} {t['dtype']} {t['target']}: {t['value']:.2f} "
            + ("met" if t["met"] else "NOT met")
            for t in doc["targets"]
        ],
        "consistent": all(all(c.values()) for c in doc["consistent"].values()),
    }


def e2e(doc: dict) -> dict:
    by = {(r["server_platform"], r["recipe"]): r for r in doc["runs"]}
    out: dict = {"raw_grpc_MB_per_s": doc["raw_grpc_MB_per_s"], "runs": {}}
    for (platform, recipe), r in by.items():
        out["runs"][f"{platform} {recipe}"] = {
            k: r[k] for k in ("qmill_MB_per_s", "ratio", "seconds", "server_cpu_s")
        }
        cpu = by.get(("cpu", recipe))
        if platform != "cpu" and cpu:
            out[f"{platform}/cpu {recipe}"] = round(r["qmill_MB_per_s"] / cpu["qmill_MB_per_s"], 2)
    return out


def flow(doc: dict) -> dict:
    out: dict = {"model": doc["model"], "export_program_s": doc.get("export_program_s")}
    steps: dict = {}
    for server in doc["servers"]:
        name = server["server_platform"]
        out[name] = {
            "up_s": server.get("server_up_s"),
            "capabilities": server.get("capabilities"),
            "runs": server["runs"],
            **({"error": server["error"]} if "error" in server else {}),
        }
        for i, run in enumerate(server.get("runs", [])):
            for k, v in run.items():
                if k.endswith("_s") and k != "server_cpu_s":
                    steps.setdefault(f"{k} run {i + 1}", {})[name] = v
    for key, per in steps.items():
        if "cpu" in per:
            for name, v in per.items():
                if name != "cpu" and v:
                    out[f"{name}/cpu time {key}"] = round(v / per["cpu"], 2)
    return out


def lm_gptq(doc: list) -> dict:
    """Issue 34: seconds per decoder layer (median after the first) on each platform and mode,
    and the CPU's over the GPU's."""
    out: dict = {}
    for run in doc:
        if "platform" in run and run.get("rc") == 0:
            key = f"{run['mode']} {run['platform']}"
            out[f"{key} s/layer"] = run["median_layer_s"]
            out[f"{key} wall s ({run['model_layers']} layers)"] = run["wall_s"]
    for mode in ("in-process", "server"):
        gpu, cpu = out.get(f"{mode} default s/layer"), out.get(f"{mode} cpu s/layer")
        if gpu and cpu:
            out[f"{mode} cpu/gpu per layer"] = round(cpu / gpu, 1)
    out |= {
        k: v
        for run in doc
        for k, v in run.items()
        if k in ("gpu_vs_cpu", "server_same_bytes_as_in_process")
    }
    return out


def main() -> int:
    out = pathlib.Path(sys.argv[1])
    summary: dict = {}
    steps = out / "steps.jsonl"
    if steps.exists():
        summary["steps"] = [json.loads(line) for line in steps.read_text().splitlines() if line]
    for name, fn in (
        ("parity", parity),
        ("engine", engine),
        ("e2e", e2e),
        ("flow", flow),
        ("lm_gptq", lm_gptq),
    ):
        doc = _load(out / f"{name}.json")
        try:
            summary[name] = fn(doc) if doc else "missing (see run_all.log)"
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            summary[name] = f"unreadable: {exc!r}"
    text = json.dumps(summary, indent=1)
    (out / "summary.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
