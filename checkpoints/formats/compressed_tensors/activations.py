"""The static-activation schemes' input scales (FP8's `input_scale`, NVFP4's
`input_global_scale`): each Linear's input range over calibration tokens, and the scale
compressed-tensors derives from it.

compressed-tensors' FP8 quantizes a Linear's input with one scale per tensor fixed at
calibration, NVFP4 its input's group scales at run time under a calibrated global scale.
llm-compressor's `oneshot` finds them with the `static_minmax` observer the presets name: the
min and max of every input the Linear saw while the calibration text ran through the model
(engine/lm/activation_ranges.py takes the same ranges in qmill's layer-by-layer run). From
a range (min, max), as compressed-tensors computes with PyTorch in the activations' dtype (the
weight's, as the model runs in it):

- FP8 `input_scale` [1], in that dtype: absmax / 448 (absmax = max(−min, max, 0)), a zero
  scale replaced by the dtype's eps.
- NVFP4 `input_global_scale` float32 [1]: 448 · 6 / absmax, as the weight's global scale
  (ct_global.global_scale).

The scales reach the writer as parts of each quantized weight's result (checkpoints/lm/
backends.py's WithInputScales), so they are kept with it for a resumed run; the writer refuses
a weight of such a scheme without one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from qmill.checkpoints.formats.compressed_tensors import global_scales as ct_global
from qmill.checkpoints.formats.compressed_tensors import schemes as ct_schemes

Range = tuple[float, float]
_FP8_MAX = 448.0


def input_part(scheme: ct_schemes.Scheme) -> str | None:
    """The part a static scheme adds to each Linear (None for a scheme without one)."""
    if not scheme.static_inputs:
        return None
    strategy = (scheme.input_activations or {}).get("strategy")
    return "input_global_scale" if strategy == "tensor_group" else "input_scale"


def needs_calibration(scheme: ct_schemes.Scheme) -> str:
    """Why `scheme` cannot be written without calibration data, and what to pass."""
    return (
        f"{scheme.name} quantizes each Linear's input with a static {input_part(scheme)} "
        "calibrated on text (llm-compressor's oneshot; its model_free_ptq refuses the scheme "
        "too): pass --calibration-text FILE or --calibration-ids IDS.npy (a Hugging Face "
        "causal-LM folder), or choose a dynamic scheme (FP8_DYNAMIC, NVFP4A16, W8A8)"
    )


def refuse_uncalibrated(recipe: Mapping[str, Any], output_format: str, what: str) -> None:
    """Refuses a run that cannot calibrate input scales (`what`: a server's job) of a
    compressed-tensors output in a static scheme, before any work rather than at its first
    tensor (the writer's check)."""
    if output_format != ct_schemes.FORMAT:
        return
    try:
        scheme = ct_schemes.scheme_of_recipe(recipe)
    except ValueError:
        return  # the writer's checks say what is wrong
    if scheme.static_inputs:
        raise ValueError(
            f"{scheme.name} quantizes each Linear's input with a static {input_part(scheme)} "
            f"calibrated on text, which {what} does not do: run `qmill quantize FOLDER --recipe "
            f"{scheme.name} --calibration-text FILE` (in process), or choose a dynamic scheme "
            "(FP8_DYNAMIC, NVFP4A16, W8A8)"
        )


def _absmax(seen: Range) -> float:
    return max(-min(seen[0], 0.0), max(seen[1], 0.0))


def fp8_input_scale(seen: Range, dtype: Any) -> np.ndarray:
    """FP8's input scale [1] in `dtype`: absmax rounded to `dtype` (what the activations hold),
    divided by 448 there (one rounding: the quotient of two bf16/f16 values is never within
    float32's rounding of a tie); 0 becomes `dtype`'s eps."""
    dtype = np.dtype(dtype)
    absmax = np.float32(np.float32(_absmax(seen)).astype(dtype))
    scale = np.asarray([absmax / np.float32(_FP8_MAX)], np.float32).astype(dtype)
    if scale[0] == 0:
        scale[0] = ml_dtypes.finfo(dtype).eps
    return scale


def nvfp4_input_global_scale(seen: Range, dtype: Any) -> np.ndarray:
    """NVFP4's input global scale float32 [1] (ct_global.global_scale of the input's absmax)."""
    absmax = float(np.float32(_absmax(seen)).astype(np.dtype(dtype)))
    return np.asarray([ct_global.global_scale(absmax, np.dtype(dtype))], np.float32)


def input_parts(
    scheme: ct_schemes.Scheme, ranges: Mapping[str, Range], dtypes: Mapping[str, Any]
) -> dict[str, dict[str, np.ndarray]]:
    """{weight path: {part: scale}} for every weight with a range (dtypes: the weights')."""
    part = input_part(scheme)
    if part is None:
        return {}
    make = nvfp4_input_global_scale if part == "input_global_scale" else fp8_input_scale
    for path, seen in ranges.items():
        if not all(math.isfinite(v) for v in seen):
            raise ValueError(
                f"{path}: its inputs on the calibration tokens are not finite ({seen}); the "
                "model overflows on them (run it in float32, or check the weights)"
            )
    return {path: {part: make(seen, dtypes[path])} for path, seen in ranges.items()}
