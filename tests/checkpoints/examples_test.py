"""The example checkpoint: deterministic, the documented tree, in every format."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp

from qmill import checkpoints
from qmill.checkpoints.formats import examples

LAYOUT = {
    "params/Conv_0/kernel": ((3, 3, 8, 16), np.float32),
    "params/Dense_0/bias": ((128,), np.float32),
    "params/Dense_0/kernel": ((64, 128), ml_dtypes.bfloat16),
    "params/Dense_1/kernel": ((128, 64), np.float32),
    "params/Embed_0/embedding": ((100, 64), np.float32),
    "step": ((), np.int32),
}


def test_the_tree_is_deterministic_and_as_documented():
    tree = examples.example_tree(0)
    assert {p: (a.shape, a.dtype) for p, a in tree.items()} == {
        p: (shape, np.dtype(dtype)) for p, (shape, dtype) in LAYOUT.items()
    }
    again = examples.example_tree(0)
    assert all(tree[p].tobytes() == again[p].tobytes() for p in tree)
    other = examples.example_tree(1)
    assert tree["params/Dense_1/kernel"].tobytes() != other["params/Dense_1/kernel"].tobytes()


def test_written_in_every_format(dest, fmt):
    examples.write_example_checkpoint(dest, fmt, seed=3)
    expected = examples.example_tree(3)
    with checkpoints.open_source(dest) as source:
        assert {e.path for e in source.entries()} == set(LAYOUT)
        for path, array in expected.items():
            assert source.read(path).tobytes() == array.tobytes()


def test_orbax_example_is_a_flax_params_tree(tmp_path):
    examples.write_example_checkpoint(tmp_path / "mlp")
    restored = ocp.PyTreeCheckpointer().restore(tmp_path / "mlp")
    assert set(restored["params"]) == {"Conv_0", "Dense_0", "Dense_1", "Embed_0"}
    assert restored["params"]["Dense_0"]["kernel"].dtype == ml_dtypes.bfloat16
