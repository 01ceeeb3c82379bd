"""Generates tests/engine/golden/qt.npz: the reference's QT gradients and the integer
dot_generals in its traced training step, for qt_golden_test.py.

How it was generated (from the repository root; qwix 0.1.8 unpacked apart from qmill's venv,
`pip install --target /tmp/qwixref --no-deps qwix-0.1.8-py3-none-any.whl`; CI never runs this and
qmill never imports qwix):

    PYTHONPATH=.:/tmp/qwixref .venv/bin/python tests/engine/make_qt_golden.py

The reference is a black box: each case's model quantized with its QtProvider, the jitted
gradients (see `compiled`) of a squared-output loss with respect to the params and the input,
and the dot_generals and convolutions of that step's jaxpr, counted by operand and accumulator
types.
Params and inputs are drawn here with numpy (no init), the same on both sides.
"""

from __future__ import annotations

import collections
import pathlib
import sys

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

OUT = pathlib.Path(__file__).parent / "golden" / "qt.npz"
W8A8 = {"weight_qtype": "int8", "act_qtype": "int8"}
# (name, dtype, rule settings): the weight gradients' tiles of 4 are too fine for a scaled
# integer product (the reference's threshold is 128): those two dots run in float.
CASES = (
    ("bf16", "bfloat16", {**W8A8, "bwd_qtype": "int8"}),
    ("f32", "float32", {**W8A8, "bwd_qtype": "int8", "bwd_weight_grad_tile_size": 4}),
)


class Net(nn.Module):
    """A conv, a dense layer and an einsum: the three ops QT runs as integer products."""

    dtype: str

    @nn.compact
    def __call__(self, x):
        kw = {"dtype": self.dtype, "param_dtype": self.dtype}
        x = nn.relu(nn.Conv(4, (3, 3), **kw)(x))
        x = nn.relu(nn.Dense(16, **kw)(x.reshape(x.shape[0], -1)))
        return nn.Einsum((16, 8), "bd,dh->bh", use_bias=False, **kw)(x)


def params(dtype: str) -> dict:
    """The model's params, drawn with numpy (no JAX op to compile)."""
    rng = np.random.default_rng(7)
    shapes = {
        "Conv_0": {"kernel": ((3, 3, 2, 4), 0.3), "bias": ((4,), 0.1)},
        "Dense_0": {"kernel": ((64, 16), 0.15), "bias": ((16,), 0.1)},
        "Einsum_0": {"kernel": ((16, 8), 0.25)},
    }
    return jax.tree.map(
        lambda s: jnp.asarray((rng.normal(size=s[0]) * s[1]).astype(np.float32), dtype),
        shapes,
        is_leaf=lambda s: isinstance(s, tuple) and isinstance(s[0], tuple),
    )


def case_input(dtype: str) -> jax.Array:
    rng = np.random.default_rng(9)
    return jnp.asarray(rng.normal(size=(8, 4, 4, 2)).astype(np.float32), dtype)


def _loss(out: jax.Array) -> jax.Array:
    return jnp.sum(jnp.square(out.astype(jnp.float32)))


def training_step(qwix, name: str):
    """(gradient function, its arguments) of a case, built with `qwix`."""
    _, dtype, settings = next(c for c in CASES if c[0] == name)
    qt = qwix.quantize_model(Net(dtype), qwix.QtProvider([qwix.QtRule(**settings)]))
    grad = jax.grad(lambda p, x: _loss(qt.apply({"params": p}, x)), argnums=(0, 1))
    return grad, (params(dtype), case_input(dtype))


def compiled(fn, args):
    """fn jitted, with every bfloat16 op rounded as written: by default XLA may keep a chain of
    them in float32 (excess precision), which moves a code wherever the chain feeds a
    quantization, depending on how the graph happens to fuse."""
    options = {"xla_allow_excess_precision": False}
    return jax.jit(fn).lower(*args).compile(compiler_options=options)


def products(fn, args) -> dict[str, int]:
    """{"<primitive> <lhs> x <rhs> -> <accumulator>": count} of the dot_generals and
    convolutions in fn's jaxpr (accumulator None: the operands' type)."""
    counts: collections.Counter[str] = collections.Counter()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
                lhs, rhs = (str(v.aval.dtype) for v in eqn.invars)
                acc = eqn.params.get("preferred_element_type")
                counts[f"{eqn.primitive.name} {lhs} x {rhs} -> {acc}"] += 1
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return dict(counts)


def record(qwix) -> dict[str, np.ndarray]:
    """{case/leaf: gradient} (floats as raw bits) and {case/products/<kind>: count}."""
    out = {}
    for name, *_ in CASES:
        fn, args = training_step(qwix, name)
        grads = jax.tree_util.tree_flatten_with_path(compiled(fn, args)(*args))[0]
        for path, leaf in grads:
            out[f"{name}/{jax.tree_util.keystr(path)}"] = as_bits(np.asarray(leaf))
        for product, count in products(fn, args).items():
            out[f"{name}/products/{product}"] = np.asarray(count)
    return out


def as_bits(a: np.ndarray) -> np.ndarray:
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


if __name__ == "__main__":
    import qwix as reference

    arrays = record(reference)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {len(arrays)} arrays to {OUT}", file=sys.stderr)
