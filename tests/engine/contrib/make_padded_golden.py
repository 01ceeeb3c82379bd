"""Generates tests/engine/contrib/golden/padded_ptq.npz: the reference's padded PTQ results for
padded_ptq_test.py.

How it was generated (from the repository root; qwix 0.1.8 unpacked apart from qmill's venv,
`pip install --target /tmp/qwixref --no-deps qwix-0.1.8-py3-none-any.whl`; CI never runs this and
qmill never imports qwix):

    PYTHONPATH=.:/tmp/qwixref .venv/bin/python tests/engine/contrib/make_padded_golden.py

The reference is a black box: padded_ptq.quantize / dequantize of contrib_cases' w with a 2-D
tile (dequantized from padded codes, see main), and for each of PAD_CASES an einsum and a
dot_general model under PaddedPtqProvider (the weight's codes and scales, the output).
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from qwix._src import model as ref_model
from qwix._src import qconfig
from qwix._src.core import qarray as ref_qarray
from qwix.contrib import padded_ptq

from tests.engine.contrib.contrib_cases import PAD_CASES, bits, codes, padded_inputs

OUT = pathlib.Path(__file__).parent / "golden" / "padded_ptq.npz"


def models(w):
    shape = w.shape

    class Ein(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.einsum("td,edf->tef", x, self.param("w", lambda *_: w, shape))

    class Dot(nn.Module):
        @nn.compact
        def __call__(self, x):
            kernel = self.param("w", lambda *_: w, shape)
            return jax.lax.dot_general(x, kernel, (([1], [1]), ([], [])))

    return {"einsum": Ein(), "dot": Dot()}


def main() -> None:
    x, w = (jnp.asarray(a) for a in padded_inputs())
    how = ref_qarray.HowToQuantize(qtype="int8", channelwise_axes=[2], tiled_axes={0: 2, 1: 16})
    q = padded_ptq.quantize(w, how)
    out = {"q2d_qvalue": codes(q), "q2d_scale": bits(q.scale)}
    out["q2d_padded_shape"] = np.array(q.padded_shape)
    # The reference's dequantize checks the codes against the scale before padding them back,
    # so it refuses unpadded codes that tiles don't divide: recorded with padded codes kept.
    padded_ptq.QARRAY_KEEP_PADDED_SHAPE = True
    kept = padded_ptq.quantize(w, how)
    padded_ptq.QARRAY_KEEP_PADDED_SHAPE = False
    out["q2d_kept_qvalue"] = codes(kept)
    out["q2d_dequantized"] = bits(padded_ptq.dequantize(kept))
    for name, wq, aq, tile in PAD_CASES:
        rule = qconfig.QuantizationRule(
            module_path=".*", weight_qtype=wq, act_qtype=aq, tile_size=tile
        )
        for kind, model in models(w).items():
            qmodel = ref_model.quantize_model(model, padded_ptq.PaddedPtqProvider([rule]))
            variables = qmodel.init(jax.random.key(0), x)
            out[f"{name}_{kind}_y"] = bits(qmodel.apply(variables, x))
            # The weight is quantized alike in both models (same contracted axis); its codes
            # are the ones quantize_params gives too.
            kernel = variables["params"]["w"].array
            out[f"{name}_qvalue"] = codes(kernel)
            out[f"{name}_scale"] = bits(kernel.scale)
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
