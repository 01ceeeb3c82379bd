"""QEP in the layer-by-layer calibration (`--method qep`): each linear's weight corrected for the
error that the layers and stages quantized before it put into its input, then GPTQ'd on the
Hessian of the input it really sees (contrib/qep_core.py has the maths; Arai & Ichikawa 2025).

The sequential scheme (sequential.py) runs a second stream beside the calibration's: the float
model's hidden states, through the float weights. At each stage both streams give the linears'
input, x (the partly quantized model's) and x_float, chunk by chunk on the same samples: H = Σ xᵀx
and H_delta = Σ (x_float − x)ᵀx (hessian.py). A linear's W becomes
W + α · W · H_delta · (H + λ)⁻¹ before GPTQ, as the reference's `qep.quantize` does stage by
stage; at layer 0 without a quantized embedding both streams are equal and W is unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from qmill.engine.contrib import qep_core


@dataclasses.dataclass(frozen=True, kw_only=True)
class QepOptions:
    """How far each weight moves towards compensating its input's error."""

    # α: 0 is plain GPTQ on the quantized model's inputs, 1 the full least-squares step; the
    # paper's (and the reference's QepRule) default 0.5: the full step over-fits the calibration.
    correction: float = 0.5
    # λ as a fraction of mean(diag H), added before inverting H for the correction (the
    # reference's QepRule.damping_factor).
    damping: float = 0.01

    def __post_init__(self) -> None:
        if not 0.0 <= self.correction <= 1.0:
            raise ValueError(f"QEP's correction must be in [0, 1], got {self.correction}")
        if not self.damping >= 0.0:
            raise ValueError(f"QEP's damping must be >= 0, got {self.damping}")


def correct(
    weights: Sequence[jax.Array],
    hessian: jax.Array,
    hessian_delta: jax.Array,
    options: QepOptions,
) -> list[jax.Array]:
    """The weights (out, in) of linears reading one input, corrected (module docstring), each
    in its own dtype: GPTQ then finds the group scales in the dtype they are stored in, as it
    does for the uncorrected weight (a bf16 weight's correction, rounded to bf16, moves it by
    ~0.4 % of an int4 step at most: 2⁻⁸ of its value), and α = 0 gives GPTQ's bytes.

    Raises:
      ValueError: a weight whose input features differ from the statistics'.
    """
    return [
        qep_core.weight_correct(
            w.astype(jax.numpy.float32),
            hessian,
            hessian_delta,
            correction_factor=options.correction,
            damping_factor=options.damping,
        ).astype(w.dtype)
        for w in weights
    ]
