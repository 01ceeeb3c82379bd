"""Why a golden case differs on this device: the differing elements and the compiled program.

    python bench/gpu/parity_detail.py [--cases 8,13,28,...] [--hlo PATH] [--float64]

device_parity.py counts, per golden case, the elements where qmill on this device differs from
the CPU fixtures (on an H200, 2026-11-26 and -27: the same 16 cases,
bench/results/h200-2026-11-27/; their causes: docs/numerics.md, "On a GPU").
This says why, for the cases given (default: those 16). For up to 6 differing codes of each case
it prints the input value, its block's scale, and the code each candidate formula gives when
computed exactly on the host in numpy (IEEE float32, as XLA:CPU does):
  recip  round(x * f32(1 / s))   the reciprocal multiply a broadcast division compiles to
  div    round(f32(x / s))       a correctly rounded true division
beside the device's code and the fixture's (with the stored scale: where scale_dtype is
narrower, as in case 151, the codes used the unrounded one). Scales that differ are printed the
same way, with float32 bits. The optimized HLO of each case's quantization is appended to PATH
(one file), to see what XLA did with the float64 route (numerics._correctly_rounded). On the CPU
every case agrees (a check that the script runs); `--float64` forces the GPU's route on the CPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine import numerics, qarray

ROOT = pathlib.Path(__file__).resolve().parents[2]
_DATA = np.load(ROOT / "tests" / "engine" / "golden" / "cases.npz")
_META = {case["id"]: case for case in json.loads(str(_DATA["meta"]))}
H200_CASES = (8, 13, 23, 28, 93, 100, 108, 116, 119, 124, 132, 144, 145, 146, 147, 151)
SHOWN = 6


def _golden(case: dict) -> dict[str, np.ndarray]:
    p = f"c{case['id']}/"
    parts = {
        "qvalue": _DATA[p + "qvalue"].astype(np.float32),
        "scale": _DATA[p + "scale"].view(jnp.dtype(case["scale_dtype_out"])).astype(np.float32),
    }
    if p + "zero_point" in _DATA:
        parts["zero_point"] = _DATA[p + "zero_point"].astype(np.float32)
    return parts


def _quantize(case: dict, x: jax.Array):
    how = qarray.HowToQuantize(
        qtype=case["qtype"],
        channelwise_axes=tuple(case["channelwise_axes"]),
        tiled_axes={a: t for a, t in case["tiled_axes"]},
        calibration_method=case["calibration_method"],
    )

    def run(x):
        q = qarray.quantize(x, how, scale_dtype=case["scale_dtype"])
        return q.qvalue, q.scale, q.zero_point

    return jax.jit(run), run(x)


def _per_element(scale: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    for axis, (n, s) in enumerate(zip(shape, scale.shape, strict=True)):
        scale = np.repeat(scale, n // s, axis=axis)
    return scale


def _bits(v: float) -> str:
    return f"{float(v):.9g} (0x{np.float32(v).view(np.uint32):08x})"


def _explain(case: dict, hlo: pathlib.Path) -> int:
    if case["noise"]:
        print(f"case {case['id']}: stochastic rounding, skipped")
        return 0
    x_host = _DATA[f"c{case['id']}/x"].view(jnp.dtype(case["dtype"]))
    x = jnp.asarray(x_host)
    fn, (qvalue, scale, zero_point) = _quantize(case, x)
    with open(hlo, "a") as f:
        f.write(f"===== case {case['id']}\n{fn.lower(x).compile().as_text()}\n")
    ours = {"qvalue": np.asarray(qvalue).astype(np.float32), "scale": np.asarray(scale, np.float32)}
    if zero_point is not None:
        ours["zero_point"] = np.asarray(zero_point).astype(np.float32)
    golden = _golden(case)
    counts = {k: int(np.sum(ours[k] != golden[k])) for k in golden}
    print(
        f"case {case['id']} {case['qtype']} {case['dtype']} {case['calibration_method']} "
        f"cw{case['channelwise_axes']} t{case['tiled_axes']}: differing {counts}"
    )
    xs = np.asarray(x_host, np.float32)
    s_gold = _per_element(golden["scale"], xs.shape)
    for i in np.flatnonzero(ours["qvalue"] != golden["qvalue"])[:SHOWN]:
        xv, sv = np.float32(xs.flat[i]), np.float32(s_gold.flat[i])
        recip = np.round(xv * (np.float32(1) / sv))
        div = np.round(np.float32(np.float64(xv) / np.float64(sv)))
        print(
            f"  code[{i}]: x {_bits(xv)} scale {_bits(sv)} -> device {ours['qvalue'].flat[i]:g} "
            f"fixture {golden['qvalue'].flat[i]:g} recip {recip:g} div {div:g}"
        )
    for name in ("scale", "zero_point"):
        if name not in golden:
            continue
        for i in np.flatnonzero(ours[name] != golden[name])[:SHOWN]:
            print(
                f"  {name}[{i}]: device {_bits(ours[name].flat[i])} "
                f"fixture {_bits(golden[name].flat[i])}"
            )
    return sum(counts.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(map(str, H200_CASES)))
    parser.add_argument("--hlo", type=pathlib.Path, default=pathlib.Path("/tmp/parity-hlo.txt"))
    parser.add_argument("--float64", action="store_true", help="the GPU's ÷ and √ on any device")
    args = parser.parse_args()
    args.hlo.write_text("")
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}")
    with numerics.float64_arithmetic(True if args.float64 else None):
        differing = [_explain(_META[int(c)], args.hlo) for c in args.cases.split(",")]
    print(f"{sum(map(bool, differing))} of {len(differing)} cases differ from the CPU fixtures")


if __name__ == "__main__":
    main()
