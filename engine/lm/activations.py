"""Dynamic quantization of the linears' inputs, as a serving stack runs a compressed-tensors
scheme with `input_activations.dynamic` (W8A8: int8 per token; FP8_DYNAMIC: float8 per token;
FP8_BLOCK: float8 per group of 128 features; MXFP4/8: per group of 32 with E8M0 scales): the
quantized model's perplexity includes it.

Each token's features (or each group of them) take scale = absmax / the qtype's bound, codes
round(x / scale) clipped, x̂ = codes · scale, in PyTorch's arithmetic as compressed-tensors
computes it (engine/core/numerics.py). x is float32 here, as in the forward pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qmill.engine.core import numerics, qarray_parts
from qmill.engine.lm import config as config_lib


def quantize_dequantize(spec: config_lib.InputQuant, x: jax.Array) -> jax.Array:
    """x (..., features) as the serving stack's dynamic quantization leaves it. Groups that do
    not divide the features leave a short last group (zeros pad it: its absmax is its own)."""
    last = x.ndim - 1
    features = x.shape[last]
    pad = -features % spec.group if spec.group else 0
    if pad:
        x = jnp.pad(x, [(0, 0)] * last + [(0, pad)])
    how = qarray_parts.HowToQuantize(
        qtype=spec.qtype,
        channelwise_axes=tuple(range(last)),
        tiled_axes={last: spec.group} if spec.group else {},
        arithmetic=numerics.TORCH,
    )
    codes, scale, zero_point = qarray_parts.quantize_bytes(x, how)
    out = qarray_parts.dequantize_bytes(codes, how.qtype, scale, zero_point)
    return out[..., :features] if pad else out
