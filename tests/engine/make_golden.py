"""Generates tests/engine/golden/cases.npz: reference quantizations for golden_test.py.

How it was generated (run from the repository root, in a venv with qwix 0.1.8 + jax 0.10.2 only;
qmill's own venv has no qwix and CI never runs this):

    /tmp/refvenv/bin/python tests/engine/make_golden.py

The reference is used as a black box: for each case we feed an input to `qwix.quantize` (or, for
stochastic rounding, its HowToQuantize with a noise function returning a fixed array) and record
qvalue, scale, zero_point and the dequantized array. Inputs are small (<= 2048 elements) so the
file stays far below 2 MB. Float arrays are stored as raw bits so comparisons are bit for bit.

Cases the reference (0.1.8) refuses but docs/numerics-spec.md defines (int16, mxfp8_16) are not
here; their tests use hand-computed expectations instead.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import qwix
from qwix._src.core import qarray as ref_qarray

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = pathlib.Path(__file__).parent / "golden" / "cases.npz"
_BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(_BITS[a.dtype.itemsize])


def _inputs(key: int, shape: tuple[int, ...], dtype, kind: str) -> np.ndarray:
    k = jax.random.key(key)
    x = jax.random.normal(k, shape, jnp.float32) * 2.0
    if kind == "shifted":
        x = x + 1.5
    elif kind == "special":
        # An all-zero block, a tiny block (scale below sqrt(tiny)), exact bound hits and ties.
        x = x.at[0].set(0.0)
        x = x.at[1].set(1e-30 if dtype != jnp.float16 else 0.0)
        x = x.at[2, :4].set(jnp.array([127.5, -127.5, 63.75, 0.5]))
        x = x.at[3, :4].set(jnp.array([2.5, -3.5, 1.5, -0.5]))
    return np.asarray(x.astype(dtype))


def _untiled_float_qtypes() -> list[str]:
    """qmill's fp8 and fp4 qtypes (float, no required tile), in the order its registry lists them.

    This venv has no qmill: engine/qtypes.py (numpy, jax and ml_dtypes only) is loaded by path.
    """
    spec = importlib.util.spec_from_file_location("qmill_qtypes", ROOT / "engine" / "qtypes.py")
    qtypes = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = qtypes  # its dataclasses look their module up while it runs
    spec.loader.exec_module(qtypes)
    records = [qtypes.get(name) for name in qtypes.names()]
    return [r.name for r in records if r.kind == qtypes.FLOAT and r.required_tile is None]


def _cases():
    """(name, qtype, dtype, shape, channelwise, tiled, method, scale_dtype, input kind, noise)."""
    f32, bf16, f16 = jnp.float32, jnp.bfloat16, jnp.float16
    ints = ["int2", "int3", "int4", "int5", "int6", "int7", "int8", "uint4", "uint8"]
    floats = _untiled_float_qtypes()
    shape = (8, 64)
    for qt in [*ints, *floats, "nf4"]:
        for dt in (bf16, f32):
            yield (qt, dt, shape, (0,), {}, "absmax", None, "normal", False)
            yield (qt, dt, shape, (0,), {1: 16}, "absmax", None, "special", False)
        yield (qt, f16, shape, (), {}, "absmax,0.9", None, "normal", False)
    for qt in ["int4", "int8"]:
        for dt in (bf16, f32, f16):
            yield (qt, dt, shape, (1,), {}, "minmax", None, "shifted", False)
            yield (qt, dt, shape, (), {0: 2, 1: 16}, "minmax,1.1", None, "special", False)
        yield (qt, bf16, shape, (0,), {}, "fixed,-2,6", None, "normal", False)
    for qt in ["int8", "int4", "float8_e4m3fn", "nf4"]:
        for dt in (bf16, f32):
            yield (qt, dt, shape, (0,), {}, "rms,3", None, "normal", False)
            yield (qt, dt, shape, (0,), {}, "fixed,-4,4", None, "normal", False)
            yield (qt, dt, shape, (), {1: 0.25}, "fixed,3", None, "normal", False)
            yield (qt, dt, shape, (), {1: 0.25}, "ABSMAX", None, "normal", False)
    for qt, tile in [("mxfp8", 32), ("mxfp4", 32), ("nvfp4", 16)]:
        for dt in (bf16, f32):
            yield (qt, dt, (4, 128), (0,), {1: tile}, "absmax", None, "normal", False)
            yield (qt, dt, (4, 128), (0,), {1: tile}, "absmax", None, "special", False)
    # Scale dtype other than the input's.
    for qt in ["int8", "int4", "nf4", "mxfp4"]:
        tiled = {1: 32} if qt == "mxfp4" else {}
        yield (qt, bf16, shape, (0,), tiled, "absmax", f32, "normal", False)
        yield (qt, f32, shape, (0,), tiled, "absmax", bf16, "special", False)
    yield ("int8", bf16, shape, (1,), {}, "minmax", f32, "shifted", False)
    yield ("int8", f32, shape, (1,), {}, "minmax", bf16, "shifted", False)
    # Stochastic rounding with a fixed noise array.
    for qt in ["int8", "int4", "float8_e4m3fn"]:
        for dt in (bf16, f32):
            yield (qt, dt, shape, (0,), {}, "absmax", None, "normal", True)
    yield ("int8", bf16, shape, (1,), {}, "minmax", None, "shifted", True)
    # Rank 3 with mixed axes.
    yield ("int8", bf16, (4, 16, 8), (2,), {1: 4}, "absmax", None, "normal", False)
    yield ("int4", f32, (4, 16, 8), (0,), {1: 8, 2: 4}, "minmax", None, "shifted", False)


def main() -> None:
    arrays: dict[str, np.ndarray] = {}
    meta = []
    for i, (qt, dt, shape, cw, tiled, method, sdt, kind, noisy) in enumerate(_cases()):
        x = _inputs(i, shape, dt, kind)
        noise = None
        if noisy:
            noise = np.asarray(
                jax.random.uniform(jax.random.key(1000 + i), shape, jnp.float32) - 0.5
            )
            how = ref_qarray.HowToQuantize(
                qtype=qt,
                channelwise_axes=cw,
                tiled_axes=tiled,
                calibration_method=method,
                noise_fn=lambda s, n=noise: jnp.asarray(n).reshape(s),
            )
            q = ref_qarray.quantize(jnp.asarray(x), how)
        else:
            q = qwix.quantize(
                jnp.asarray(x),
                qt,
                channelwise_axes=cw,
                tiled_axes=tiled,
                calibration_method=method,
                scale_dtype=sdt,
            )
        deq = np.asarray(qwix.dequantize(q))
        p = f"c{i}/"
        arrays[p + "x"] = _bits(x)
        arrays[p + "qvalue"] = np.asarray(q.qvalue).astype(np.float32)
        arrays[p + "scale"] = _bits(np.asarray(q.scale))
        arrays[p + "dequantized"] = _bits(deq)
        if q.zero_point is not None:
            arrays[p + "zero_point"] = np.asarray(q.zero_point).astype(np.int32)
        if noise is not None:
            arrays[p + "noise"] = noise
        meta.append(
            {
                "id": i,
                "qtype": qt,
                "dtype": np.dtype(dt).name,
                "shape": list(shape),
                "channelwise_axes": list(cw),
                "tiled_axes": [[a, t] for a, t in tiled.items()],
                "calibration_method": method,
                "scale_dtype": None if sdt is None else np.dtype(sdt).name,
                "noise": noisy,
                "qvalue_dtype": np.dtype(q.qvalue.dtype).name,
                "scale_dtype_out": np.dtype(q.scale.dtype).name,
                "dequantized_dtype": deq.dtype.name,
            }
        )
    arrays["meta"] = np.asarray(json.dumps(meta))
    OUT.parent.mkdir(exist_ok=True)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {len(meta)} cases to {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    assert ml_dtypes is not None
    main()
