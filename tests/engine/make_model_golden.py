"""Generates tests/engine/golden/models.npz: whole PTQ models quantized by the reference, eagerly
and under nnx.jit, for model_golden_test.py.

Under nnx.jit XLA compiles weight quantization together with the rest of the model and rounds
some quotients differently from the op-by-op (eager) run: the reference's own jitted codes differ
from its eager ones (7 of 1024 in linear1 of the f32 model). qmill must match the reference in
both modes, not just eagerly. Run from the repository root in the reference venv (qwix 0.1.8,
jax 0.10.2; never a qmill dependency, CI never runs this):

    /tmp/refvenv/bin/python tests/engine/make_model_golden.py
"""

from __future__ import annotations

import pathlib
import sys

import jax
import numpy as np
from flax import nnx

OUT = pathlib.Path(__file__).parent / "golden" / "models.npz"
# (name, weight qtype, act qtype, param dtype)
CASES = (
    ("w8a8_f32", "int8", "int8", "float32"),
    ("w8_bf16", "int8", None, "bfloat16"),
    ("w4a8_f32", "int4", "int8", "float32"),
)


class Mlp(nnx.Module):
    def __init__(self, dtype: str, *, rngs: nnx.Rngs) -> None:
        self.linear1 = nnx.Linear(16, 64, use_bias=False, param_dtype=dtype, rngs=rngs)
        self.linear2 = nnx.Linear(64, 16, use_bias=False, param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


def model_input() -> jax.Array:
    return jax.random.uniform(jax.random.key(0), (8, 16))


def quantized_models(qwix, weight_qtype: str, act_qtype: str | None, dtype: str):
    """(jitted, eager) PTQ models built by `qwix` (the reference or qmill.engine)."""
    rules = [
        qwix.QuantizationRule(module_path=".*", weight_qtype=weight_qtype, act_qtype=act_qtype)
    ]

    def create():
        return qwix.quantize_model(
            Mlp(dtype, rngs=nnx.Rngs(0)), qwix.PtqProvider(rules), model_input()
        )

    return nnx.jit(create)(), create()


def flat_state(model) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model)))[0]
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}


def record(qwix) -> dict[str, np.ndarray]:
    """{case/mode/leaf: array}, floats as raw bits so comparisons are bit for bit."""
    out = {}
    for name, wq, aq, dtype in CASES:
        for mode, model in zip(
            ("jit", "eager"), quantized_models(qwix, wq, aq, dtype), strict=True
        ):
            leaves = flat_state(model)
            leaves["output"] = np.asarray(model(model_input()))
            for leaf, value in leaves.items():
                out[f"{name}/{mode}/{leaf}"] = as_bits(value)
    return out


def as_bits(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
        return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])
    if a.dtype.itemsize < 1 or a.dtype.name in ("int4", "uint4"):
        return a.astype(np.int8)
    return a


if __name__ == "__main__":
    import qwix as reference

    arrays = record(reference)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {len(arrays)} arrays to {OUT}", file=sys.stderr)
