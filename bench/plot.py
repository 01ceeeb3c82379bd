"""Plots the recorded benchmark results: throughput per qtype (engine), per replica count (e2e)
and per number of concurrent streams to one server (e2e --streams); with --lm-gptq, instead,
peak RSS and wall time of GPTQ against a language model's depth, per tool (lm_gptq_bench.py).

    pip install -e ".[bench]"
    python bench/plot.py [--engine bench/results/engine-cpu.json] [--e2e bench/results/e2e.json]
                         [--streams bench/results/e2e-streams.json]
                         [-o bench/results/throughput.png]
    python bench/plot.py --lm-gptq bench/results/lm-gptq-peer-depth.json [-o PNG; default:
                         the JSON's path with .png]

Reads the JSON files that `engine_bench.py --json` and `e2e_bench.py --json` write; draws
nothing it did not read, and says which inputs were missing.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

RESULTS = pathlib.Path(__file__).parent / "results"


def _engine_panel(ax, doc: dict, path: str) -> None:
    """% of the run's own baseline (bytes in + out) per case and input dtype: numpy copy on a
    CPU, jitted copy on a GPU (XLA:CPU's jitted copy is ~4x slower than numpy's, too weak a bar
    there). The baselines differ by dtype, so bars of GB/s alone would not compare."""
    on_gpu = doc.get("platform") == "gpu"
    key, name = ("jitted_copy", "jitted copy") if on_gpu else ("numpy_copy", "numpy copy")
    rows = [r for r in doc["results"] if r["path"] == path]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    width = 0.8 / len(dtypes)
    for i, dtype in enumerate(dtypes):
        pct = [
            next(r[f"pct_{key}"] for r in rows if r["case"] == c and r["dtype"] == dtype)
            for c in cases
        ]
        copy = doc["baselines"][dtype][f"{key}_gbs"]
        xs = [j + i * width for j in range(len(cases))]
        bars = ax.bar(xs, pct, width, label=f"{dtype} input ({name} {copy:.1f} GB/s)")
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.axhline(100, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks([j + width * (len(dtypes) - 1) / 2 for j in range(len(cases))], cases)
    ax.set_ylabel(f"% of {name} bandwidth")
    n = doc.get("size", "")
    ax.set_title(f"engine on {doc.get('platform', 'cpu')}, {n}x{n} ({path} path)")
    ax.legend(fontsize=7)


def _e2e_panel(ax, doc: dict) -> None:
    runs = doc["runs"]
    recipes = list(dict.fromkeys(r["recipe"] for r in runs))
    counts = sorted({r["replicas"] for r in runs})
    width = 0.8 / len(counts)
    for i, n in enumerate(counts):
        mbs = [
            next((r["qmill_MB_per_s"] for r in runs if r["recipe"] == c and r["replicas"] == n), 0)
            for c in recipes
        ]
        xs = [j + i * width for j in range(len(recipes))]
        bars = ax.bar(xs, mbs, width, label=f"{n} replica{'s' if n > 1 else ''}")
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    raw = doc["raw_grpc_MB_per_s"]
    ax.axhline(raw, color="grey", linestyle="--", linewidth=1)
    ax.text(
        len(recipes) - 0.5, raw, f"raw gRPC {raw:.0f} MB/s", va="bottom", ha="right", fontsize=7
    )
    ax.set_xticks([j + width * (len(counts) - 1) / 2 for j in range(len(recipes))], recipes)
    ax.set_ylabel("MB/s of float checkpoint")
    ax.set_title(f"qmill quantize --server, {doc['checkpoint_MB']:.0f} MB checkpoint")
    ax.legend(fontsize=7)


def _streams_panel(ax, doc: dict) -> None:
    """Throughput against the number of concurrent streams to one server, per recipe."""
    runs = [r for r in doc["runs"] if r["replicas"] == 1]
    recipes = list(dict.fromkeys(r["recipe"] for r in runs))
    counts = sorted({r.get("streams", 1) for r in runs})
    width = 0.8 / len(recipes)
    for i, recipe in enumerate(recipes):
        mbs = [
            next(
                (
                    r["qmill_MB_per_s"]
                    for r in runs
                    if r["recipe"] == recipe and r.get("streams", 1) == n
                ),
                0,
            )
            for n in counts
        ]
        xs = [j + i * width for j in range(len(counts))]
        bars = ax.bar(xs, mbs, width, label=recipe)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    raw = doc["raw_grpc_MB_per_s"]
    ax.axhline(raw, color="grey", linestyle="--", linewidth=1)
    ax.text(
        len(counts) - 0.5, raw, f"raw gRPC, 1 stream {raw:.0f} MB/s", va="bottom", ha="right",
        fontsize=7,
    )  # fmt: skip
    ax.set_xticks([j + width * (len(recipes) - 1) / 2 for j in range(len(counts))], counts)
    ax.set_xlabel("concurrent streams to one server (qmill quantize --streams N)")
    ax.set_ylabel("MB/s of float checkpoint")
    ax.set_title(f"parallel streams, {doc['checkpoint_MB']:.0f} MB checkpoint")
    ax.legend(fontsize=7)


def _depth_panels(rss_ax, wall_ax, doc: dict) -> None:
    """Peak RSS and wall time of each tool's whole GPTQ command against the number of decoder
    layers kept (the same calibration tokens at every depth)."""
    rows = doc["depth"]
    names = {"peer": "llm-compressor oneshot", "qmill": "qmill quantize --method gptq"}
    for tool in dict.fromkeys(r["tool"] for r in rows):
        mine = sorted((r for r in rows if r["tool"] == tool), key=lambda r: r["layers"])
        layers, label = [r["layers"] for r in mine], names.get(tool, tool)
        rss_ax.plot(layers, [r["peak_rss_mb"] for r in mine], marker="o", label=label)
        wall_ax.plot(layers, [r["wall_s"] for r in mine], marker="o", label=label)
    samples = doc.get("depth_samples", doc["calibration"]["samples"])
    tokens = f"{samples} x {doc['calibration']['seq_len']} calibration tokens"
    for ax, what in ((rss_ax, "peak RSS (MB)"), (wall_ax, "wall time (s)")):
        ax.set_xlabel("decoder layers kept")
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.set_title(f"GPTQ W4A16, {what.split(' (')[0]}, {tokens}", fontsize=9)
        ax.legend(fontsize=7)


def _depth_figure(plt, path: str, output: str | None) -> int:
    doc = json.loads(pathlib.Path(path).read_text())
    if not doc.get("depth"):
        print(f"{path} has no depth series", file=sys.stderr)
        return 1
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    _depth_panels(axes[0], axes[1], doc)
    m = doc.get("machine", {})
    fig.suptitle(f"{doc.get('model', '')}; {m.get('cpu', '')}, {m.get('cores', '')} cores — "
                 f"{doc.get('date', '')}", fontsize=8)  # fmt: skip
    fig.tight_layout()
    output = output or str(pathlib.Path(path).with_suffix(".png"))
    fig.savefig(output, dpi=120)
    print(f"wrote {output}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default=str(RESULTS / "engine-cpu.json"))
    parser.add_argument("--e2e", default=str(RESULTS / "e2e.json"))
    parser.add_argument("--streams", default=str(RESULTS / "e2e-streams.json"))
    parser.add_argument("--lm-gptq", help="lm_gptq_bench.py's JSON: its depth series alone")
    parser.add_argument("-o", "--output")
    args = parser.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: pip install -e '.[bench]'", file=sys.stderr)
        return 1
    if args.lm_gptq:
        return _depth_figure(plt, args.lm_gptq, args.output)
    args.output = args.output or str(RESULTS / "throughput.png")
    docs = {}
    for name, path in (("engine", args.engine), ("e2e", args.e2e), ("streams", args.streams)):
        if pathlib.Path(path).is_file():
            docs[name] = json.loads(pathlib.Path(path).read_text())
        else:
            print(f"{path} not found: its panel is left out", file=sys.stderr)
    if not docs:
        return 1
    fig, axes = plt.subplots(1, len(docs), figsize=(6.5 * len(docs), 4.2), squeeze=False)
    panels = iter(axes[0])
    if "engine" in docs:
        _engine_panel(next(panels), docs["engine"], "bytes")
    if "e2e" in docs:
        _e2e_panel(next(panels), docs["e2e"])
    if "streams" in docs:
        _streams_panel(next(panels), docs["streams"])
    source = docs.get("e2e") or docs["engine"]
    fig.suptitle(f"{source.get('machine', '')} — {source.get('date', '')}", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
