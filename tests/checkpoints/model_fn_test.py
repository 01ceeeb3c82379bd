"""checkpoints/programs/model_fn.py: `--model-fn path/to/file.py:function` loads the file as a
module."""

from __future__ import annotations

import pathlib

import numpy as np

from qmill.checkpoints.programs import model_fn

MODEL = """
from __future__ import annotations

import numpy as np
from flax import linen as nn


class Scaled(nn.Module):
    features: int = 4  # a dataclass field: made while the module runs, found in sys.modules

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.features)(x)


def build():
    return {"model": Scaled(), "inputs": np.zeros((1, 3), np.float32)}
"""


def test_a_file_whose_linen_module_has_fields_loads(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "my_model.py"
    path.write_text(MODEL)
    built = model_fn.load(f"{path}:build")
    assert built.model.features == 4
    assert len(built.inputs) == 1 and built.inputs[0].shape == (1, 3)
    assert built.inputs[0].dtype == np.float32
