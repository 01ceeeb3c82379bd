"""Algorithms beyond plain round-to-nearest PTQ (the reference's qwix.contrib): GPTQ, AWQ and
SmoothQuant, each a rule, a calibration provider, quantize_params (and, where the params carry
extra scales, an inference provider); hadamard_rot, the rotation that spreads activation outliers
before 4-bit quantization; qep, GPTQ stage by stage, each stage's weights corrected for the error
the earlier stages put into their inputs; padded_ptq, PTQ with tiles that need not divide their
axis; and sparsity.sparsity_module, N:M sparsity kept as
model state for quantized training."""

from qmill.engine.contrib import awq as awq
from qmill.engine.contrib import awq_core as awq_core
from qmill.engine.contrib import calibration as calibration
from qmill.engine.contrib import gptq as gptq
from qmill.engine.contrib import gptq_core as gptq_core
from qmill.engine.contrib import hadamard_rot as hadamard_rot
from qmill.engine.contrib import padded_ptq as padded_ptq
from qmill.engine.contrib import qep as qep
from qmill.engine.contrib import qep_core as qep_core
from qmill.engine.contrib import smooth_quant as smooth_quant
from qmill.engine.contrib import sparsity as sparsity

__all__ = [
    "awq",
    "awq_core",
    "calibration",
    "gptq",
    "gptq_core",
    "hadamard_rot",
    "padded_ptq",
    "qep",
    "qep_core",
    "smooth_quant",
    "sparsity",
]
