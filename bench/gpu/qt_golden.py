"""Issue 40's QT training steps on the device: qmill's and the reference's (qwix 0.1.8, from
.whl) gradients computed here, compared bit for bit with each other and, in machine epsilons of
the largest gradient, with the CPU recording (tests/engine/golden/qt.npz), plus each traced
step's integer-product counts. One JSON object on stdout.

  python3 bench/gpu/qt_golden.py [--json PATH]   (after `source bench/gpu/setup.sh`)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax
import ml_dtypes
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from tests.engine import make_qt_golden as golden


def _eps_units(got: np.ndarray, want_bits: np.ndarray) -> float:
    """max |got − want| in machine epsilons of the largest |want|."""
    dtype = {2: ml_dtypes.bfloat16, 4: np.float32}[want_bits.dtype.itemsize]
    want = want_bits.view(dtype).astype(np.float64)
    scale = float(ml_dtypes.finfo(dtype).eps) * max(np.abs(want).max(), 1e-30)
    return float(np.abs(got.view(dtype).astype(np.float64) - want).max() / scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    import qmill.engine as ours

    recorded = dict(np.load(golden.OUT))
    mine = golden.record(ours)
    try:
        import qwix as reference

        theirs = golden.record(reference)
    except ImportError as err:  # the wheel did not install: still compare with the CPU record
        theirs, why = None, str(err)
    except jax.errors.JaxRuntimeError as err:  # qwix 0.1.8's int8 convolutions on a GPU
        theirs, why = None, str(err).strip().splitlines()[0]
    cases = {}
    for key, bits in sorted(mine.items()):
        case = cases.setdefault(key.split("/")[0], {"max_eps_vs_cpu": 0.0, "bits_differ": 0})
        if "/products/" in key:
            case.setdefault("products", {})[key.split("/products/")[1]] = int(bits)
            case["products_equal_cpu"] = case.get("products_equal_cpu", True) and (
                key in recorded and int(recorded[key]) == int(bits)
            )
            continue
        case["max_eps_vs_cpu"] = max(case["max_eps_vs_cpu"], _eps_units(bits, recorded[key]))
        if theirs is not None:
            case["bits_differ"] += int(np.count_nonzero(bits != theirs[key]))
    out = {
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
        "reference": "qwix 0.1.8 on this device" if theirs is not None else f"failed: {why}",
        "cases": cases,
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
