"""The calibration methods of a language model (`--method`), for lm_calibration.py: which engine
function calibrates a layer, what the quantized model's forward pass does to the linears' inputs,
and how progress and reports name each method's measure.

  gptq              GPTQ on each linear (engine/lm/sequential.py)
  awq               AWQ's scales folded into the norms and linears before each group of linears,
                    then round to nearest (engine/lm/smoothing.py, awq.py, folds.py)
  awq+gptq          the same fold, then GPTQ
  smoothquant       SmoothQuant's scales folded into the norms before q/k/v and gate/up, then
                    round to nearest
  smoothquant+gptq  the same fold, then GPTQ
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from qmill.checkpoints.formats.compressed_tensors import schemes as ct_schemes

METHODS = ("gptq", "awq", "awq+gptq", "smoothquant", "smoothquant+gptq")


def check(method: str, alpha: float, grid: int) -> None:
    """Refuses an unknown method or options out of range.

    Raises:
      ValueError: saying which and what to give.
    """
    if method not in METHODS:
        raise ValueError(f"method {method!r} is not one of {', '.join(METHODS)}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"the SmoothQuant strength must be in [0, 1], not {alpha}")
    if grid < 2:
        raise ValueError(f"the AWQ grid takes at least 2 points, not {grid}")


def smoothing(method: str) -> str | None:
    """The smoothing the method folds first ("awq" or "smoothquant"), or None."""
    first = method.split("+")[0]
    return None if first == "gptq" else first


def uses_gptq(method: str) -> bool:
    """Whether the linears are GPTQ'd (else rounded to nearest after the fold)."""
    return method.endswith("gptq")


def layer_calibrator(request: Any) -> Callable[..., Any]:
    """f(cfg, layer, tensors, hidden, plans) -> sequential.LayerCalibration for the request's
    method (an lm_calibration.LmRequest)."""
    from qmill.engine.contrib import gptq_core
    from qmill.engine.lm import awq, sequential
    from qmill.engine.lm import smoothing as smoothing_lib

    gptq = None
    if uses_gptq(request.method):
        gptq = gptq_core.GptqOptions(
            blocksize=request.blocksize, percdamp=request.percdamp, actorder=request.actorder
        )
    fold = smoothing(request.method)
    experts = {"all_experts": request.all_experts}
    if fold is None:
        return lambda *args: sequential.calibrate_layer(*args, gptq, **experts)
    options = smoothing_lib.SmoothingOptions(
        method=fold, awq=awq.AwqOptions(n_grid=request.awq_grid), alpha=request.smoothquant_alpha
    )
    return lambda *args: smoothing_lib.calibrate_layer(*args, options, gptq, **experts)


def quantized_config(cfg: Any, recipe: Mapping[str, Any]) -> Any:
    """The LmConfig `cfg` as the quantized model runs: with a compressed-tensors scheme whose
    input activations are dynamic (W8A8 / INT8 and the WnA8 / WnA4 family, FP8_DYNAMIC,
    FP8_BLOCK, W4AFP8, MXFP4, MXFP8), each linear's input quantized on the fly
    (engine/lm/activations.py), as vLLM and transformers run it; otherwise `cfg`.

    Raises:
      ValueError: a scheme with static input scales (FP8, NVFP4), which `--method` does not
        calibrate (they are calibrated without it: client/static_activations.py).
    """
    from qmill.engine.lm import config as config_lib

    try:
        scheme = ct_schemes.scheme_of_recipe(recipe)
    except ValueError:
        return cfg  # not a compressed-tensors scheme: weights only
    act = scheme.input_activations
    if act is None:
        return cfg
    if scheme.static_inputs:
        raise ValueError(
            f"{scheme.name}'s static input scales are calibrated without --method (weights "
            "rounded to nearest, as llm-compressor's QuantizationModifier): drop --method"
        )
    bits = int(act["num_bits"])
    if act["type"] == "int":
        qtype = f"int{bits}"
    elif act.get("scale_dtype") == "torch.uint8":  # MX: E8M0 scales per group of 32
        qtype = f"mxfp{bits}"
    else:
        qtype = "float8_e4m3fn"
    group = act["group_size"] if act.get("strategy") == "group" else None
    return dataclasses.replace(cfg, input_quant=config_lib.InputQuant(qtype=qtype, group=group))


def layer_line(
    method: str, layer: int, layers: int, loss: float, seconds: float, eta: float
) -> str:
    """The progress text of one finished layer ("layer 3/30: GPTQ loss 0.012, 4.1 s, ETA 110 s"):
    GPTQ's loss, AWQ's block-output error without GPTQ, no number for SmoothQuant alone."""
    if uses_gptq(method):
        measure = f"GPTQ loss {loss:.4g}, "
    elif method == "awq":
        measure = f"AWQ output MSE {loss:.4g}, "
    else:
        measure = ""
    return f"layer {layer + 1}/{layers}: {measure}{seconds:.1f} s, ETA {eta:.0f} s"


def report_options(request: Any, methods: Mapping[str, str]) -> dict[str, Any]:
    """The report's method options: GPTQ's, AWQ's grid, SmoothQuant's strength, and (with a
    fold) each calibrated linear's method, which a --server client reads there."""
    out: dict[str, Any] = {}
    if uses_gptq(request.method):
        out["gptq"] = {
            "block_size": request.blocksize,
            "dampening": request.percdamp,
            "actorder": "static" if request.actorder else None,
        }
    fold = smoothing(request.method)
    if fold == "awq":
        out["awq"] = {"n_grid": request.awq_grid, "duo_scaling": True}
    elif fold == "smoothquant":
        out["smoothquant"] = {"alpha": request.smoothquant_alpha}
    if fold is not None:
        out["methods"] = dict(methods)
    return out
