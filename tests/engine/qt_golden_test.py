"""QT training steps as the reference's (qwix 0.1.8, recorded by make_qt_golden.py): the same
integer products in the traced step (a bf16 model's forward and backward dot_generals and
convolutions all int8 × int8 → int32) and the same gradients.

The gradients are compiled with every bf16 op rounded as written (make_qt_golden.compiled): XLA's
default licence to keep bf16 chains in float32 makes a jitted bf16 step depend on how its graph
fuses (ours and the reference's fuse differently, and a chain feeding a quantization then moves
codes: 1-2 % of the gradients). So compiled, or run op by op, ours equal the reference's bit for
bit (measured). They are compared within MAX_EPS machine epsilons of the largest gradient, as
model_golden_test compares outputs: float dots (here a fallback for finely tiled gradients) may
round differently on another CPU; one wrong code moves a gradient by about one bf16 epsilon of
the largest, a wrong scale or a misplaced axis by tens to thousands.
"""

import ml_dtypes
import numpy as np
import pytest

import qmill.engine as qwix
from tests.engine import make_qt_golden as golden

FIXTURES = np.load(golden.OUT)
MAX_EPS = {"float32": 8, "bfloat16": 0.5}


@pytest.fixture(scope="module", params=[case[0] for case in golden.CASES])
def step(request):
    fn, args = golden.training_step(qwix, request.param)
    return request.param, fn, args


def _recorded(name: str, kind: str) -> dict[str, np.ndarray]:
    prefix = f"{name}/{kind}" if kind else f"{name}/"
    return {k[len(prefix) :]: FIXTURES[k] for k in FIXTURES if k.startswith(prefix)}


def test_the_traced_step_has_the_references_integer_products(step):
    name, fn, args = step
    expected = {k: int(v) for k, v in _recorded(name, "products/").items()}
    assert golden.products(fn, args) == expected
    if name == "bf16":  # everything quantized: every product is an integer one
        assert expected and all("int8 x int8 -> int32" in k for k in expected)


def test_gradients_equal_the_references(step):
    name, fn, args = step
    grads = golden.compiled(fn, args)(*args)
    leaves = golden.jax.tree_util.tree_flatten_with_path(grads)[0]
    expected = {k: v for k, v in _recorded(name, "").items() if not k.startswith("products/")}
    assert sorted(expected) == sorted(golden.jax.tree_util.keystr(p) for p, _ in leaves)
    for path, leaf in leaves:
        key = golden.jax.tree_util.keystr(path)
        dtype = {2: ml_dtypes.bfloat16, 4: np.float32}[expected[key].dtype.itemsize]
        want = expected[key].view(dtype).astype(np.float64)
        got = np.asarray(leaf).astype(np.float64)
        eps = MAX_EPS[np.dtype(dtype).name]
        unit = float(ml_dtypes.finfo(dtype).eps) * np.abs(want).max()
        assert np.abs(got - want).max() <= eps * unit, (name, key)
