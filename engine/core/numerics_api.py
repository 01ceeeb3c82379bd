"""The reference's public numerics helpers, re-exported by numerics.py (which keeps the engine's
own formulations and convert_to, which is built on them): bounds, the quantizable dtypes, and
conversion from qtypes."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from qmill.engine.core import qtypes

_QUANTIZABLE = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64)


def get_symmetric_bound(qtype: Any) -> float:
    """B in ``scale = absmax / B`` for symmetric quantization to `qtype` (docs/numerics-spec.md,
    "Bounds").

    Raises:
      ValueError: not a qtype (e.g. bfloat16): the message lists the valid ones.
    """
    return float(qtypes.get(qtype).bound)


def get_asymmetric_bound(qtype: Any) -> tuple[float, float]:
    """(qmin, qmax) that asymmetric quantization to `qtype` maps a [min, max] range onto.

    Raises:
      ValueError: a qtype without asymmetric quantization (only int4, int8, int16 have it).
    """
    qt = qtypes.get(qtype)
    if qt.asymmetric_range is None:
        raise ValueError(
            f"{qt.name} doesn't support asymmetric quantization; use int4, int8 or int16, or a "
            "symmetric calibration (absmax)"
        )
    lo, hi = qt.asymmetric_range
    return float(lo), float(hi)


def should_quantize(dtype: Any) -> bool:
    """Whether arrays of `dtype` are quantizable (bfloat16, float16, float32, float64)."""
    return jnp.dtype(dtype) in _QUANTIZABLE


def can_dequant_on_output(qtype: Any) -> bool:
    """Whether codes of `qtype` are uniform, so a matmul may run on them and scale its output
    (not nf4, whose codes index a table of levels)."""
    return qtypes.get(qtype).kind != qtypes.LOOKUP


def convert_from(x: jax.Array, qtype: Any) -> jax.Array:
    """Inverse of convert_to's representation change: nf4 indices become their levels (float32);
    other codes are returned as they are (scaling is dequantize's job)."""
    qt = qtypes.get(qtype)
    if qt.kind != qtypes.LOOKUP:
        return x
    return jnp.take(jnp.asarray(qt.levels, jnp.float32), x.astype(jnp.int32), axis=0)


def get_nf4_buckets() -> jax.Array:
    """The 16 NormalFloat4 levels (QLoRA, appendix E), ascending; index = code."""
    return jnp.asarray(qtypes.NF4_LEVELS, jnp.float32)
