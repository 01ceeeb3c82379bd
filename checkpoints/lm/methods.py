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
  qep               QEP: each linear corrected for the error the quantized layers before it put
                    into its input, then GPTQ (engine/lm/qep.py; dense models)
  hadamard          the residual stream rotated by a Hadamard matrix fused into the weights
                    (norms folded into the linears after them, the embedding and head rotated
                    too), then round to nearest (engine/lm/rotation.py; dense models)
  hadamard+gptq     the same rotation, then GPTQ
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from qmill.checkpoints.formats.compressed_tensors import schemes as ct_schemes

METHODS = (
    "gptq", "awq", "awq+gptq", "smoothquant", "smoothquant+gptq", "qep",
    "hadamard", "hadamard+gptq",
)  # fmt: skip
# The rotation's seeds: what the wire's uint32 holds.
SEEDS = range(2**32)


def check(request: Any) -> None:
    """Refuses an unknown method or options out of range (of an lm_calibration.LmRequest).

    Raises:
      ValueError: saying which and what to give.
    """
    if request.method not in METHODS:
        raise ValueError(f"method {request.method!r} is not one of {', '.join(METHODS)}")
    if request.hadamard_seed not in SEEDS:
        raise ValueError(f"the Hadamard seed must be in [0, 2^32), not {request.hadamard_seed}")
    if not 0.0 <= request.qep_correction <= 1.0:
        raise ValueError(f"QEP's correction must be in [0, 1], not {request.qep_correction}")
    if not 0.0 <= request.smoothquant_alpha <= 1.0:
        raise ValueError(
            f"the SmoothQuant strength must be in [0, 1], not {request.smoothquant_alpha}"
        )
    if request.awq_grid < 2:
        raise ValueError(f"the AWQ grid takes at least 2 points, not {request.awq_grid}")


def check_recipe(method: str, recipe: Mapping[str, Any]) -> None:
    """Refuses, before any work, a recipe `method` cannot calibrate: the one check that the
    in-process run, CalibrateLanguageModel and a job's SubmitJob make (and `calibrate` again).

    Raises:
      ValueError: a static-activation scheme (FP8, NVFP4: calibrated without a method), with
        AWQ or SmoothQuant NVFP4A16 (its global scales), or with a GPTQ method a quantizing rule
        whose numerics GPTQ cannot follow (micro-scaled MX / NVFP4 scales, FP8_BLOCK's 2-D
        blocks), saying what runs instead.
    """
    scheme = _scheme_of(recipe)
    if scheme is not None and scheme.static_inputs:
        raise ValueError(static_refusal(scheme))
    fold = smoothing(method)
    if rotates(method) and scheme is not None and scheme.format == ct_schemes.NVFP4:
        raise ValueError(
            f"--method {method} cannot calibrate {scheme.name}: its global scales are found "
            "from the weights before the rotation changes them. Instead run no --method (round "
            f"to nearest), or --method {method} with a scheme without a global scale (W4A16, "
            "W8A8, ...)"
        )
    if fold is not None and scheme is not None and scheme.format == ct_schemes.NVFP4:
        # The plan finds each NVFP4 global scale from the source's weight, which the fold then
        # scales: the codes would be written against a global scale they were not made with.
        raise ValueError(
            f"--method {method} cannot calibrate {scheme.name}: its global scales are found "
            f"from the weights before the fold changes them. Instead run no --method (round to "
            f"nearest), or --method {fold} with a scheme without a global scale (MXFP4A16, "
            "W4A16, ...)"
        )
    if not uses_gptq(method):
        return
    from qmill.engine.contrib import leaf
    from qmill.engine.modelfree import recipes as recipes_lib

    for rule in recipes_lib.recipe_from_mapping(recipe).rules:
        why = None if rule.skip else leaf.gptq_refusal(rule)
        if why is None:
            continue
        what = scheme.name if scheme is not None else f"rule {rule.path_regex!r} ({rule.qtype})"
        first = fold or ("hadamard" if rotates(method) else None)
        instead = f"--method {first}" if first else "--method awq or smoothquant"
        raise ValueError(
            f"--method {method} cannot calibrate {what}: {why}. Instead run {instead} (the "
            "fold or rotation, then round to nearest) or no --method (round to nearest), or a "
            f"scheme GPTQ takes: {gptq_schemes()}"
        )


def notices(method: str, recipe: Mapping[str, Any]) -> list[str]:
    """Lines a user should read before a run the method allows but that measured badly: the
    rotation rounded to nearest with 4-bit weights (docs/calibrated-methods.md, Hadamard)."""
    scheme = _scheme_of(recipe)
    if method != "hadamard" or scheme is None or scheme.num_bits >= 8:
        return []
    return [
        "note: --method hadamard rounds the rotated weights to nearest; with "
        f"{scheme.num_bits}-bit weights that measured worse than no rotation (SmolLM2-135M W4A16: "
        "held-out perplexity "
        "44.0 -> 74.5, docs/calibrated-methods.md). For 4-bit weights rotate with "
        "--method hadamard+gptq"
    ]


def static_refusal(scheme: ct_schemes.Scheme) -> str:
    """Why a static-activation scheme (FP8, NVFP4) takes no --method."""
    return (
        f"{scheme.name}'s static input scales are calibrated without --method (weights "
        "rounded to nearest, as llm-compressor's QuantizationModifier): drop --method"
    )


def gptq_schemes() -> str:
    """The compressed-tensors schemes GPTQ calibrates, as a message lists them (the integer
    WnAm family as its first and last member)."""
    from qmill.engine.contrib import leaf
    from qmill.engine.modelfree import recipes as recipes_lib

    names = [
        s.name
        for s in ct_schemes.SCHEMES.values()
        if not s.static_inputs and leaf.gptq_refusal(recipes_lib.rule_from_mapping(s.rule)) is None
    ]
    family = [n for n in names if re.fullmatch(r"W\dA\d+", n) and n not in _NAMED_WNAM]
    main = [n for n in names if n not in family]
    return ", ".join(main) + (f" or the WnAm family ({family[0]} … {family[-1]})" if family else "")


# The WnAm schemes a message names on their own; the others are "the WnAm family".
_NAMED_WNAM = ("W4A16", "W8A16", "W8A8")


def _scheme_of(recipe: Mapping[str, Any]) -> ct_schemes.Scheme | None:
    try:
        return ct_schemes.scheme_of_recipe(recipe)
    except ValueError:
        return None  # not a compressed-tensors scheme's recipe (qmill's own layout)


def smoothing(method: str) -> str | None:
    """The smoothing the method folds first ("awq" or "smoothquant"), or None."""
    first = method.split("+")[0]
    return first if first in ("awq", "smoothquant") else None


def uses_gptq(method: str) -> bool:
    """Whether the linears are GPTQ'd (else rounded to nearest after the fold)."""
    return method.endswith("gptq") or method == "qep"


def propagates_float(method: str) -> bool:
    """Whether the run carries the float model's hidden states beside the calibration's (QEP's
    second stream)."""
    return method == "qep"


def rotates(method: str) -> bool:
    """Whether the method rotates the residual stream (hadamard, hadamard+gptq)."""
    return method.split("+")[0] == "hadamard"


def check_model(method: str, cfg: Any) -> None:
    """Refuses, before any work, a model the method cannot calibrate.

    Raises:
      ValueError: QEP on a mixture of experts (its experts see other tokens in the float and
        the quantized model: no paired inputs to correct with); the rotation on a model it does
        not fuse into (engine/lm/rotation.check).
    """
    if method == "qep" and cfg.moe is not None:
        raise ValueError(
            f"--method qep calibrates dense models; this {cfg.model_type} model has experts: "
            "use --method gptq (or awq, smoothquant, ...)"
        )
    if rotates(method):
        from qmill.engine.lm import rotation

        rotation.check(cfg)


def untie(method: str, cfg: Any) -> tuple[str, str] | None:
    """(head, embedding): the tensor names of a tied head that the output of `method` holds
    as a tensor of its own (a rotated head carries the final norm's scale, the embedding does
    not: plan.make's `untie`), or None."""
    if not rotates(method) or not cfg.tied:
        return None
    from qmill.engine.lm import config as config_lib
    from qmill.engine.lm import rotation

    names = config_lib.outer_tensor_names(rotation.untied(cfg))
    return names["head"], names["embed"]


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
    if rotates(request.method):
        from qmill.engine.lm import rotation

        turn = rotation.RotationOptions(seed=request.hadamard_seed)
        return lambda *args: rotation.calibrate_layer(*args, turn, gptq)
    if propagates_float(request.method):
        from qmill.engine.lm import qep

        options = qep.QepOptions(correction=request.qep_correction)
        return lambda *args, reference=None: sequential.calibrate_layer(
            *args, gptq, qep=options, reference=reference
        )
    if fold is None:
        return lambda *args: sequential.calibrate_layer(*args, gptq, **experts)
    options = smoothing_lib.SmoothingOptions(
        method=fold,
        awq=awq.AwqOptions(n_grid=request.awq_grid, clip=request.awq_clip),
        alpha=request.smoothquant_alpha,
    )
    return lambda *args: smoothing_lib.calibrate_layer(*args, options, gptq, **experts)


def outer_as_run(request: Any, cfg: Any, outer: Mapping[str, Any]) -> Mapping[str, Any]:
    """The embedding, final norm and head (float, as read) as the calibrated model runs them:
    rotated by a Hadamard method (engine/lm/rotation.rotate_outer), else `outer` itself."""
    if not rotates(request.method):
        return outer
    from qmill.engine.lm import rotation

    rot = rotation.rotation(cfg.hidden_size, request.hadamard_seed)
    return rotation.rotate_outer(cfg, outer, rot)


def outer_folded(request: Any, cfg: Any, run_outer: Mapping[str, Any]) -> dict[str, Any]:
    """Full name → the embedding, final norm and head a Hadamard method changed (outer_as_run's,
    in their own dtypes), kept with layer 0's results; {} for other methods."""
    if not rotates(request.method):
        return {}
    from qmill.engine.lm import config as config_lib
    from qmill.engine.lm import rotation

    names = config_lib.outer_tensor_names(rotation.untied(cfg))  # a tied head: its own now
    return {names[k]: np.asarray(run_outer[k]) for k in ("embed", "norm", "head")}


def run_config(request: Any, cfg: Any) -> Any:
    """The LmConfig the calibrated model runs its head with: untied where rotated (the
    embedding and the head differ then: outer_as_run)."""
    if not rotates(request.method):
        return cfg
    from qmill.engine.lm import rotation

    return rotation.untied(cfg)


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
        raise ValueError(static_refusal(scheme))
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
    if method == "qep":
        measure = f"QEP+GPTQ loss {loss:.4g}, "
    elif uses_gptq(method):
        measure = f"GPTQ loss {loss:.4g}, "
    elif method == "awq":
        measure = f"AWQ output MSE {loss:.4g}, "
    else:
        measure = ""
    return f"layer {layer + 1}/{layers}: {measure}{seconds:.1f} s, ETA {eta:.0f} s"


def clips(request: Any) -> bool:
    """Whether the run clips AWQ's weights (engine/lm/awq_clip.py): `awq` by round to nearest,
    unless --no-awq-clip; never with GPTQ, which fits the rounding itself."""
    return request.method == "awq" and request.awq_clip


def fingerprint(request: Any) -> dict[str, Any]:
    """The method's part of a kept calibration's fingerprint: none for plain GPTQ, so that one
    kept before methods existed still matches; "clip" came later, so an AWQ run kept without
    clipping is not resumed by one with it."""
    if request.method == "gptq":
        return {}
    if request.method == "qep":
        return {"method": ["qep", request.qep_correction]}
    if rotates(request.method):
        return {"method": [request.method, request.hadamard_seed]}
    options = [request.method, request.smoothquant_alpha, request.awq_grid]
    return {"method": options + (["clip"] if clips(request) else [])}


def report_options(request: Any, methods: Mapping[str, str]) -> dict[str, Any]:
    """The report's method options: GPTQ's, AWQ's grid, SmoothQuant's strength, QEP's
    correction, and (for every method but GPTQ alone) each calibrated linear's method, which a
    --server client reads there."""
    out: dict[str, Any] = {}
    if uses_gptq(request.method):
        out["gptq"] = {
            "block_size": request.blocksize,
            "dampening": request.percdamp,
            "actorder": "static" if request.actorder else None,
        }
    if request.method == "qep":
        from qmill.engine.lm import qep

        options = qep.QepOptions(correction=request.qep_correction)
        out["qep"] = {"correction_factor": options.correction, "damping_factor": options.damping}
    if rotates(request.method):
        out["hadamard"] = {"seed": request.hadamard_seed, "rotations": ["residual"]}
    fold = smoothing(request.method)
    if fold == "awq":
        out["awq"] = {"n_grid": request.awq_grid, "duo_scaling": True, "clip": clips(request)}
    elif fold == "smoothquant":
        out["smoothquant"] = {"alpha": request.smoothquant_alpha}
    if request.method != "gptq":
        out["methods"] = dict(methods)
    return out
