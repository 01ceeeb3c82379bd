"""Checks bit-for-bit agreement with the reference ON THE CURRENT DEVICE (e.g. a GPU).

golden_test.py compares against fixtures the reference produced on CPU. On another backend XLA
may round some steps differently (division, sqrt, fused multiply-add), and then the reference
itself no longer matches its CPU fixtures. This script runs the reference (Qwix 0.1.8, a black-box
oracle, never a dependency) and qmill side by side on the default device, for every golden case,
and prints where qmill differs from the reference on that device and where either differs from
the CPU fixtures. qmill aims at the CPU fixtures' bits on every device (numerics, "Division off
the CPU": ÷ and √ in float64 built from bits, sums in the CPU's order; E4M3 by integer ops),
so "qmill-vs-cpu" is the column to watch; "qmill-vs-ref" on a GPU only shows where the
reference itself drifts. Run by hand where qwix is importable:

    python tests/engine/device_parity.py [--json PATH] [--max-seconds S] [--spread N]
                                         [--require-equal] [--gpu-route]

`--require-equal` is the device check of issue 37: it exits 1 unless every case ran and every
one equals the CPU fixtures (qmill-vs-cpu), printing PASS or FAIL as its last line.

`--json` also writes every case's differing element counts (0 = same bits) per comparison;
`--max-seconds` starts no case after S seconds (the summary then says how many ran): on a GPU
every op of both libraries compiles on first use, which takes far longer than on the CPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from qwix._src.core import qarray as ref_qarray

from qmill.engine import numerics, qarray

_DATA = np.load(pathlib.Path(__file__).parent / "golden" / "cases.npz")
_META = json.loads(str(_DATA["meta"]))


def _parts(q) -> dict[str, np.ndarray]:
    parts = {
        "qvalue": np.asarray(q.qvalue).astype(np.float32),
        "scale": np.asarray(q.scale).astype(np.float32),
    }
    if q.zero_point is not None:
        parts["zero_point"] = np.asarray(q.zero_point).astype(np.float32)
    return parts


def _golden(case: dict) -> dict[str, np.ndarray]:
    p = f"c{case['id']}/"
    parts = {
        "qvalue": _DATA[p + "qvalue"],
        "scale": _DATA[p + "scale"].view(jnp.dtype(case["scale_dtype_out"])).astype(np.float32),
    }
    if p + "zero_point" in _DATA:
        parts["zero_point"] = _DATA[p + "zero_point"].astype(np.float32)
    return parts


def _diff(a: dict, b: dict) -> str:
    out = []
    for k in a:
        if k not in b or a[k].shape != b[k].shape:
            out.append(f"{k}:structure")
        elif not np.array_equal(a[k], b[k], equal_nan=True):
            n = int(np.sum(~((a[k] == b[k]) | (np.isnan(a[k]) & np.isnan(b[k])))))
            out.append(f"{k}:{n}/{a[k].size}")
    return " ".join(out)


def _count(diff: str) -> int:
    """Differing elements in a _diff string (-1 for a structure difference)."""
    if "structure" in diff:
        return -1
    return sum(int(part.split(":")[1].split("/")[0]) for part in diff.split())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write per-case counts here")
    parser.add_argument("--max-seconds", type=float, help="start no case after this many seconds")
    parser.add_argument(
        "--spread", type=int, default=1,
        help="run every N-th case first, then the next N-th...: a run cut short by --max-seconds "
        "still covers every kind of case (the golden cases are grouped by qtype)",
    )  # fmt: skip
    parser.add_argument(
        "--require-equal", action="store_true",
        help="exit 1 unless all cases ran and qmill equals the CPU fixtures in every one",
    )  # fmt: skip
    parser.add_argument(
        "--gpu-route", action="store_true",
        help="force the GPU's arithmetic (numerics.float64_arithmetic) on any device: on a CPU, "
        "a check that it gives the fixtures' bits",
    )  # fmt: skip
    args = parser.parse_args()
    if args.gpu_route:
        with numerics.float64_arithmetic(True):
            _run(args)
    else:
        _run(args)


def _run(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    device = jax.devices()[0]
    route = numerics.gpu_route()
    print(f"device {device.device_kind}, jax {jax.__version__}, GPU route {route}")
    bad_vs_ref = bad_ref_vs_cpu = bad_vs_cpu = 0
    rows = []
    order = [c for k in range(args.spread) for c in _META[k :: args.spread]]
    for case in order:
        if args.max_seconds and time.perf_counter() - start > args.max_seconds:
            print(f"stopped after {len(rows)} cases: --max-seconds {args.max_seconds:g}")
            break
        p = f"c{case['id']}/"
        x = jnp.asarray(_DATA[p + "x"].view(jnp.dtype(case["dtype"])))
        tiled = {a: t for a, t in case["tiled_axes"]}
        noise_fn = None
        if case["noise"]:
            noise = jnp.asarray(_DATA[p + "noise"])
            noise_fn = lambda shape, n=noise: n.reshape(shape)  # noqa: E731
        cw = tuple(case["channelwise_axes"])
        method = case["calibration_method"]
        sdt = case["scale_dtype"]
        # How both sides quantize: the reference's HowToQuantize takes the same fields as ours.
        axes = {"channelwise_axes": cw, "tiled_axes": tiled, "calibration_method": method}
        if noise_fn is not None:
            ref_how = ref_qarray.HowToQuantize(qtype=case["qtype"], noise_fn=noise_fn, **axes)
            ref = ref_qarray.quantize(x, ref_how)
        else:
            ref = qwix.quantize(x, case["qtype"], scale_dtype=sdt, **axes)
        how = qarray.HowToQuantize(qtype=case["qtype"], noise_fn=noise_fn, **axes)
        ours = qarray.quantize(x, how, scale_dtype=sdt)
        d_ref = _diff(_parts(ours), _parts(ref))
        d_cpu = _diff(_parts(ref), _golden(case))
        d_ours_cpu = _diff(_parts(ours), _golden(case))
        bad_vs_ref += bool(d_ref)
        bad_ref_vs_cpu += bool(d_cpu)
        bad_vs_cpu += bool(d_ours_cpu)
        rows.append(
            dict(id=case["id"], qtype=case["qtype"], dtype=case["dtype"], method=method,
                 qmill_vs_cpu=_count(d_ours_cpu), qmill_vs_ref=_count(d_ref),
                 ref_vs_cpu=_count(d_cpu), detail=d_ours_cpu)
        )  # fmt: skip
        if d_ref or d_cpu or d_ours_cpu:
            print(
                f"case {case['id']:3d} {case['qtype']:>16} {case['dtype']:>8} {method:>12} "
                f"cw{cw} t{tiled} s{sdt}: qmill-vs-cpu[{d_ours_cpu or 'same'}] "
                f"qmill-vs-ref[{d_ref or 'same'}] ref-vs-cpu[{d_cpu or 'same'}]"
            )
    print(
        f"{len(rows)} of {len(_META)} cases: qmill differs from the CPU fixtures in {bad_vs_cpu} "
        f"and from the reference on this device in {bad_vs_ref}; the reference differs from its "
        f"CPU fixtures in {bad_ref_vs_cpu}"
    )
    if args.json:
        summary = dict(cases=len(_META), cases_run=len(rows),
                       seconds=round(time.perf_counter() - start, 1), qmill_vs_cpu=bad_vs_cpu,
                       qmill_vs_ref=bad_vs_ref, ref_vs_cpu=bad_ref_vs_cpu)  # fmt: skip
        doc = dict(device=device.device_kind, platform=device.platform, jax=jax.__version__,
                   summary=summary, cases=rows)  # fmt: skip
        pathlib.Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if args.require_equal:
        equal = len(rows) - bad_vs_cpu
        if len(rows) == len(_META) and bad_vs_cpu == 0:
            print(f"PASS: {equal}/{len(_META)} cases equal the CPU fixtures")
        else:
            print(f"FAIL: {equal}/{len(_META)} cases equal the CPU fixtures ({len(rows)} ran)")
            sys.exit(1)


if __name__ == "__main__":
    main()
