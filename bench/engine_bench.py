"""Engine throughput on the default device (CPU, or a GPU where jax has one): quantize n×n tensors.

Run: python bench/engine_bench.py [--size 4096] [--repeats 5] [--json results.json]
     (on a GPU: --size 8192)

Cases: int8, fp8 (float8_e4m3fn) and nf4 channelwise (axis 1), int4 with tiles of 128 on axis 0
(channelwise on axis 1), each on bf16 and f32 input. Paths, each timed best-of-repeats:
  quantize  jit(qarray.quantize): device array in, QArray out (4-bit codes packed by XLA).
  bytes     jit(qarray.quantize_bytes): the same, 4-bit codes as uint8 bytes (what leaf.py runs).
  eager     qarray.quantize called without jit, as quantize_params calls it: the NaN/Inf check
            included, and on the CPU 4-bit codes computed as bytes and packed by numpy.
  donated   `quantize` with the input buffer donated (a fresh device copy per run, untimed).
  leaf      leaf.quantize_leaf: host numpy in, host numpy out plus the quality figures; the
            service's per-tensor unit of work (transfers and the SQNR pass included).
Throughput = (input bytes + qvalue bytes (itemsize, 1 for 4-bit) + scale bytes) / time, compared
with baselines measured in the same run: numpy copy (np.copyto, bytes in + out; the CPU
reference) and a jitted copy (device to device; the GPU reference). Transfers: host→device of the
input, device→host of the outputs (packed 4-bit vs bytes). Each quantize path is checked to give
the same bits as `quantize`. The targets of issue #2 are evaluated on the `quantize`, `bytes` and
`eager` paths and printed with the ratios.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import time
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine import qarray
from qmill.engine.modelfree import layout, leaf

CASES: dict[str, dict] = {
    "int8": dict(qtype="int8", channelwise_axes=(1,)),
    "fp8": dict(qtype="float8_e4m3fn", channelwise_axes=(1,)),
    "int4 tile 128": dict(qtype="int4", channelwise_axes=(1,), tiled_axes={0: 128}),
    "nf4": dict(qtype="nf4", channelwise_axes=(1,)),
}
# Issue #2: (name, dtypes, numerator case, denominator case or None for % of copy, bound, kind).
TARGETS = [
    ("int8 >= 40 % of copy", "int8", None, 40.0, "min"),
    ("nf4 / int8 <= 3", "nf4", "int8", 3.0, "max"),
    ("int4 tile 128 / int8 <= 2", "int4 tile 128", "int8", 2.0, "max"),
]


def _best_of(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best wall time of each fn over `repeats` runs, after one warm-up each.

    The fns run round robin, so load from other processes (a shared machine) hits them alike.
    A fn may be a (setup, fn) pair: setup() runs untimed and its result is fn's argument.
    """
    pairs = {k: v if isinstance(v, tuple) else (None, v) for k, v in fns.items()}

    def once(setup, fn) -> float:
        arg = setup() if setup else None
        t0 = time.perf_counter()
        fn(arg) if setup else fn()
        return time.perf_counter() - t0

    for setup, fn in pairs.values():
        once(setup, fn)
    best = dict.fromkeys(pairs, float("inf"))
    for _ in range(repeats):
        for k, (setup, fn) in pairs.items():
            best[k] = min(best[k], once(setup, fn))
    return best


def _best(fn: Callable[..., object], repeats: int, setup: Callable[[], object] | None = None):
    return _best_of({"_": (setup, fn) if setup else fn}, repeats)["_"]


def _numpy_copy_gbs(nbytes: int, repeats: int) -> float:
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return 2 * nbytes / _best(lambda: np.copyto(dst, src), repeats) / 1e9


def _jitted_copy_gbs(x: jax.Array, repeats: int) -> float:
    copy = jax.jit(jnp.copy)
    return 2 * x.nbytes / _best(lambda: copy(x).block_until_ready(), repeats) / 1e9


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _bench_case(x_host, x, name, kw, dtype_name, repeats, copy_gbs, jcopy_gbs):
    """Times every path of one case; returns (result rows, transfer rows, consistency)."""
    how = qarray.HowToQuantize(**kw)
    quantize = jax.jit(functools.partial(qarray.quantize, how=how))
    as_bytes = jax.jit(functools.partial(qarray.quantize_bytes, how=how))
    donated = jax.jit(functools.partial(qarray.quantize, how=how), donate_argnums=0)
    plan = layout.LeafPlan(
        path="bench", qtype=kw["qtype"], channelwise_axes=kw["channelwise_axes"],
        tiled_axes=tuple(kw.get("tiled_axes", {}).items()),
    )  # fmt: skip
    q = quantize(x)
    out_bytes = q.qvalue.size * q.qvalue.dtype.itemsize + q.scale.nbytes
    moved = x.nbytes + out_bytes
    fresh = lambda: jax.device_put(x_host).block_until_ready()  # noqa: E731
    seconds = _best_of(
        {
            "quantize": lambda: jax.block_until_ready(quantize(x)),
            "bytes": lambda: jax.block_until_ready(as_bytes(x)),
            "eager": lambda: jax.block_until_ready(qarray.quantize(x, how)),
            "donated": (fresh, lambda a: jax.block_until_ready(donated(a))),
        },
        repeats,
    )
    seconds["leaf"] = _best(lambda: leaf.quantize_leaf(x_host, plan), repeats)
    rows = []
    for path, t in seconds.items():
        gbs = moved / t / 1e9
        rows.append(
            dict(dtype=dtype_name, case=name, path=path, ms=t * 1e3, gbs=gbs,
                 pct_numpy_copy=100 * gbs / copy_gbs, pct_jitted_copy=100 * gbs / jcopy_gbs)
        )  # fmt: skip
    # Device -> host of the outputs: the packed 4-bit qvalue vs the bytes (fresh arrays per run,
    # since a jax array caches its host copy).
    transfers = []
    for what, produce, pick in [
        ("qvalue", lambda: quantize(x), lambda r: r.qvalue),
        ("qvalue as bytes", lambda: as_bytes(x), lambda r: r[0]),
        ("scale", lambda: quantize(x), lambda r: r.scale),
    ]:
        arr = pick(produce())
        t = _best(
            np.asarray, repeats, setup=lambda p=produce, k=pick: k(jax.block_until_ready(p()))
        )
        transfers.append(
            dict(dtype=dtype_name, case=name, what=f"device->host {what} ({arr.dtype})",
                 ms=t * 1e3, gbs=arr.nbytes / t / 1e9)
        )  # fmt: skip
    codes, scale, _ = as_bytes(x)
    result = leaf.quantize_leaf(x_host, plan)
    expected = np.asarray(q.qvalue)
    consistent = {
        "bytes": _same(qarray.storage_view(np.asarray(codes), kw["qtype"]), expected)
        and _same(np.asarray(scale), np.asarray(q.scale)),
        "eager": _same(np.asarray(qarray.quantize(x, how).qvalue), expected),
        "donated": _same(np.asarray(donated(jax.device_put(x_host)).qvalue), expected),
        # 4-bit codes leave the leaf packed: compare them unpacked.
        "leaf": _same(result.codes(), expected) and _same(result.scale, np.asarray(q.scale)),
    }
    return rows, transfers, consistent


def _targets(rows: list[dict], on_gpu: bool) -> list[dict]:
    pct = "pct_jitted_copy" if on_gpu else "pct_numpy_copy"
    by = {(r["dtype"], r["case"], r["path"]): r for r in rows}
    out = []
    for path in ("quantize", "bytes", "eager"):
        for dtype in sorted({r["dtype"] for r in rows}):
            for label, num, den, bound, kind in TARGETS:
                a = by[(dtype, num, path)]
                value = a[pct] if den is None else a["ms"] / by[(dtype, den, path)]["ms"]
                met = value >= bound if kind == "min" else value <= bound
                out.append(dict(target=label, dtype=dtype, path=path, value=value, met=met))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=4096, help="n of the n×n tensors")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measure (best)")
    parser.add_argument("--json", metavar="PATH", help="write all results here as JSON")
    args = parser.parse_args()
    # Donating an input whose buffer no output can reuse only warns; that is what is measured.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    n, device = args.size, jax.devices()[0]
    on_gpu = device.platform == "gpu"
    header = dict(
        date=str(datetime.date.today()), machine=platform.machine(),
        processor=platform.processor(), jax=jax.__version__, platform=device.platform,
        device=device.device_kind, size=n, repeats=args.repeats,
        baseline="jitted copy" if on_gpu else "numpy copy",
    )  # fmt: skip
    print(f"# {' '.join(str(v) for v in header.values())}")
    baselines, rows, transfers, consistent = {}, [], [], {}
    for dtype in (jnp.bfloat16, jnp.float32):
        dname = jnp.dtype(dtype).name
        x_host = np.asarray(jax.random.normal(jax.random.key(0), (n, n), jnp.float32)).astype(dtype)
        t_h2d = _best(lambda a=x_host: jax.device_put(a).block_until_ready(), args.repeats)
        x = jax.device_put(x_host).block_until_ready()
        copy_gbs = _numpy_copy_gbs(x.nbytes, args.repeats)
        jcopy_gbs = _jitted_copy_gbs(x, args.repeats)
        baselines[dname] = dict(numpy_copy_gbs=copy_gbs, jitted_copy_gbs=jcopy_gbs)
        transfers.append(
            dict(dtype=dname, case="input", what="host->device input", ms=t_h2d * 1e3,
                 gbs=x.nbytes / t_h2d / 1e9)
        )  # fmt: skip
        print(
            f"\n{dname} {n}x{n}: numpy copy {copy_gbs:.2f} GB/s, jitted copy {jcopy_gbs:.2f} "
            f"GB/s, host->device {t_h2d * 1e3:.2f} ms"
        )
        for name, kw in CASES.items():
            r, t, c = _bench_case(x_host, x, name, kw, dname, args.repeats, copy_gbs, jcopy_gbs)
            rows += r
            transfers += t
            consistent[f"{dname} {name}"] = c
            pct = "pct_jitted_copy" if on_gpu else "pct_numpy_copy"
            cells = "  ".join(f"{e['path']} {e['ms']:7.2f} ms {e[pct]:5.1f} %" for e in r)
            print(f"  {name:14s} {cells}")
            for e in t:
                print(f"  {'':14s} {e['what']}: {e['ms']:.2f} ms")
            if not all(c.values()):
                print(f"  {'':14s} MISMATCH with quantize: {c}")
    targets = _targets(rows, on_gpu)
    print(f"\ntargets (% of {header['baseline']}; ratios of ms):")
    for e in targets:
        mark = "met" if e["met"] else "NOT met"
        print(f"  {e['path']:8s} {e['dtype']:8s} {e['target']:26s} {e['value']:7.2f}  {mark}")
    if args.json:
        doc = dict(header, baselines=baselines, results=rows, transfers=transfers,
                   consistent=consistent, targets=targets)  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
