"""Generates tests/engine/contrib/golden/qep.npz: the reference's QEP results for
qep_golden_test.py.

How it was generated (from the repository root; qwix 0.1.8 unpacked apart from qmill's venv,
`pip install --target /tmp/qwixref --no-deps qwix-0.1.8-py3-none-any.whl`; CI never runs this and
qmill never imports qwix):

    PYTHONPATH=.:/tmp/qwixref .venv/bin/python tests/engine/contrib/make_qep_golden.py

The reference is a black box: qep_core on contrib_cases' inputs, and qep.quantize on the Branch
model for each of QEP_CASES (codes, scales, statistics, stages and the PTQ model's output).
The reference's qep.quantize runs GPTQ op by op, whose later group scales differ from its own
jitted GPTQ by a few ulp (as make_contrib_golden.py says); qmill always compiles GPTQ. So the
run is recorded twice: with the reference's gptq_core.quantize_weight under jax.jit (everything
compared), and as it is (its codes, compared too: they are the same).
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from qwix.contrib import gptq_core, qep, qep_core

from tests.engine.contrib.contrib_cases import (
    KERNELS,
    QEP_CASES,
    Branch,
    bits,
    qep_inputs,
)

OUT = pathlib.Path(__file__).parent / "golden" / "qep.npz"


def main() -> None:
    w, x, x_q, batches = (jnp.asarray(a) if i < 3 else a for i, a in enumerate(qep_inputs()))
    stats = qep_core.compute_qep_stats(x_q, x)
    out = {f"core_{k}": bits(v) for k, v in stats.items()}
    out["core_corrected"] = bits(
        qep_core.weight_correct(w, stats["hessian"], stats["hessian_delta"])
    )
    model = Branch()
    variables = model.init(jax.random.key(41), batches[0])
    for name, qtype, tile, block in QEP_CASES:
        rules = [qep.QepRule(module_path=".*", weight_qtype=qtype, tile_size=tile)]
        result = qep.quantize(model, batches, rules, variables=variables, gptq_block_size=block)
        for module, param in KERNELS:
            q = result.params[module][param].array
            out[f"{name}_{module}_qvalue_eager"] = bits(q.qvalue)
    eager = gptq_core.quantize_weight

    def jitted(W, H, how, blocksize=128, percdamp=0.01):
        fn = functools.partial(eager, how=how, blocksize=blocksize, percdamp=percdamp)
        return jax.jit(fn)(W, H)  # how (a dict inside) is bound, not hashed

    gptq_core.quantize_weight = jitted
    for name, qtype, tile, block in QEP_CASES:
        rules = [qep.QepRule(module_path=".*", weight_qtype=qtype, tile_size=tile)]
        result = qep.quantize(model, batches, rules, variables=variables, gptq_block_size=block)
        out[f"{name}_stages"] = np.array([",".join(stage.module_paths) for stage in result.stages])
        for module, param in KERNELS:
            q = result.params[module][param].array
            out[f"{name}_{module}_qvalue"] = bits(q.qvalue)
            out[f"{name}_{module}_scale"] = bits(q.scale)
            stat = result.quant_stats[module][param + "_qep"]
            out[f"{name}_{module}_hessian"] = bits(stat["sum_of_hessian"])
            out[f"{name}_{module}_delta"] = bits(stat["sum_of_hessian_delta"])
        out[f"{name}_y"] = bits(result.model.apply({"params": result.params}, batches[0]))
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
