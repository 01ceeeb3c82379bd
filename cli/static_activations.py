"""`qmill quantize FOLDER --recipe FP8 --calibration-text f.txt`: the static-activation
compressed-tensors schemes (FP8's input_scale, NVFP4's input_global_scale), calibrated in this
process on a Hugging Face causal LM.

As llm-compressor's `oneshot` with its QuantizationModifier: the weights are rounded to nearest,
and each Linear's input range comes from a run of the float model over the calibration tokens,
layer by layer (checkpoints/lm_activations.py). Each quantized weight's result then carries its
Linear's input scale to the writer (checkpoints/lm/backends.WithInputScales).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from qmill.checkpoints.formats.compressed_tensors import activations as ct_activations
from qmill.checkpoints.formats.compressed_tensors import schemes as ct_schemes
from qmill.checkpoints.lm import calibration as lm_calibration
from qmill.cli import calibrated_lm

_CALIBRATION_FLAGS = ("calibration_text", "calibration_ids")
_LM_ONLY_FLAGS = ("method", "eval_text", "eval_ids", "max_ppl_increase")


def checked_scheme(
    args: argparse.Namespace, scheme: ct_schemes.Scheme | None
) -> ct_schemes.Scheme | None:
    """The run's compressed-tensors scheme (its plan's; None for qmill's layout) when it takes
    static activation scales (None otherwise), once what it cannot be written with is refused,
    before any work.

    Raises:
      ValueError: no calibration data, a server (the ranges are found in this process), or a
        --method run's flags (GPTQ takes neither FP8's one scale per weight nor NVFP4's global
        scale yet).
    """
    if scheme is None or not scheme.static_inputs:
        return None
    if all(getattr(args, f, None) is None for f in _CALIBRATION_FLAGS):
        raise ValueError(ct_activations.needs_calibration(scheme))
    if args.server:
        raise ValueError(
            f"{scheme.name}'s input scales are calibrated in this process: drop --server"
        )
    given = [f for f in _LM_ONLY_FLAGS if getattr(args, f, None) is not None]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ValueError(
            f"{scheme.name} is calibrated with its weights rounded to nearest (as "
            f"llm-compressor's QuantizationModifier): drop {flag}; qmill's GPTQ takes neither "
            "FP8's one scale per weight nor NVFP4's global scale yet"
        )
    return scheme


def _ranges(args: argparse.Namespace, recipe: dict[str, Any]) -> dict[str, ct_activations.Range]:
    """Each linear's input range on the calibration tokens, the float model run layer by
    layer, with a progress line per layer (or as an interrupted run kept them)."""
    from qmill.checkpoints.lm import activations as lm_activations  # lazy: the engine (jax)

    ids = calibrated_lm.calibration_ids(args)

    def progress(layer: int, layers: int, seconds: float) -> None:
        if not args.quiet:
            print(
                f"qmill: layer {layer + 1}/{layers}: activation ranges, {seconds:.1f} s",
                file=sys.stderr,
                flush=True,
            )

    return lm_activations.kept_or_collect(
        args.source,
        args.output,
        recipe,
        ids,
        restart=args.restart,
        all_experts=args.calibrate_all_experts,
        progress=progress,
        notice=calibrated_lm.notice(args),
    )


def input_parts(
    args: argparse.Namespace, recipe: dict[str, Any], plan: Any, scheme: ct_schemes.Scheme | None
) -> dict[str, dict[str, Any]] | None:
    """{weight path: {input part: scale}} for every weight the run's `plan` quantizes, or None
    without a static scheme (lm_activations.input_parts says what it refuses); `recipe`, as
    loaded, names the kept ranges (an output in the way was refused by the plan)."""
    if scheme is None:
        return None
    from qmill.checkpoints.lm import activations as lm_activations  # lazy: the engine (jax)

    ranges = _ranges(args, recipe)
    try:
        return lm_activations.input_parts(plan, ranges)
    except ValueError:
        # Ranges a rerun with what the message asks for (another recipe, all experts) would
        # not match: kept, they would only make it pass --restart.
        lm_calibration.discard(args.output)
        raise


def with_input_scales(backend: Any, parts: dict[str, dict[str, Any]] | None) -> Any:
    """`backend`, its results carrying their input scales when there are any."""
    from qmill.checkpoints.lm import backends as lm_backends

    return lm_backends.WithInputScales(backend, parts) if parts else backend
