"""Generates tests/engine/contrib/golden/contrib.npz: the reference's GPTQ, AWQ and SmoothQuant
results for contrib_golden_test.py.

How it was generated (from the repository root, in a venv with qwix 0.1.8 added by hand with
`pip install --no-deps qwix==0.1.8`; CI never runs this and qmill never imports qwix):

    python tests/engine/contrib/make_contrib_golden.py

The reference is a black box: inputs made here from fixed keys, its outputs recorded as raw bits.
GPTQ is recorded under jax.jit: the reference's eager run differs from its own jitted one by an
ulp in later group scales (XLA fuses the column updates differently), and qmill matches the
jitted one. Asymmetric GPTQ is not recorded: the reference 0.1.8 fails on zero points.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from qwix._src import model as ref_model
from qwix._src.core import qarray as ref_qarray
from qwix._src.providers import ptq as ref_ptq
from qwix.contrib import awq_core, gptq_core
from qwix.contrib import smooth_quant as ref_sq

from tests.engine.contrib.contrib_cases import GPTQ_CASES, Mlp, bits, digest, inputs

OUT = pathlib.Path(__file__).parent / "golden" / "contrib.npz"


def _how(qtype, tile):
    return ref_qarray.HowToQuantize(
        qtype=qtype, channelwise_axes=[0], tiled_axes={1: tile} if tile else {}
    )


def main() -> None:
    data = inputs()
    # The inputs are rebuilt by the test from the same keys; their digest says they are the same.
    out = {"inputs_sha256": np.frombuffer(digest(data), np.uint8)}
    w, x, acts = (jnp.asarray(data[k]) for k in ("w", "x", "acts"))
    for name, qtype, tile, block in GPTQ_CASES:
        fn = functools.partial(gptq_core.quantize_weight, how=_how(qtype, tile), blocksize=block)
        q, losses = jax.jit(fn)(w, gptq_core.compute_hessian(x))
        out |= {f"gptq_{name}_qvalue": bits(q.qvalue), f"gptq_{name}_scale": bits(q.scale)}
        out[f"gptq_{name}_losses"] = bits(losses)
    q, scales = awq_core.quantize_weight(w, awq_core.compute_act_scale(acts), _how("int4", 32))
    out |= {"awq_qvalue": bits(q.qvalue), "awq_scale": bits(q.scale), "awq_s": bits(scales)}
    # SmoothQuant through the model API: statistics of two batches, then quantize_params.
    model = Mlp()
    variables = model.init(jax.random.key(1), acts[:8])
    rules = [ref_sq.SqRule(module_path="Dense_0", weight_qtype="int8", act_qtype="int8")]
    calibrating = ref_model.quantize_model(model, ref_sq.SqCalibrationProvider(rules))
    for batch in (acts[:32], acts[32:]):
        _, new = calibrating.apply(variables, batch, mutable="quant_stats")
        variables = {**variables, **new}
    stats = variables["quant_stats"]["Dense_0"]["kernel_sq"]
    out |= {
        "sq_sum": bits(stats["sum_of_sq_scale"]),
        "sq_inv_sum": bits(stats["sum_of_inv_sq_scale"]),
    }
    ptq_model = ref_model.quantize_model(model, ref_ptq.PtqProvider(rules))
    abstract = jax.eval_shape(ptq_model.init, jax.random.key(1), acts[:8])["params"]
    params = ref_sq.quantize_params(variables["params"], abstract, variables["quant_stats"])
    kernel = params["Dense_0"]["kernel"]
    out |= {"sq_qvalue": bits(kernel.array.qvalue), "sq_scale": bits(kernel.array.scale)}
    out["sq_y"] = bits(
        ref_model.quantize_model(model, ref_sq.SqInferenceProvider(rules)).apply(
            {"params": params}, acts[:8]
        )
    )
    OUT.parent.mkdir(exist_ok=True)
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
