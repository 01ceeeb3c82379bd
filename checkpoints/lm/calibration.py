"""A Hugging Face causal-LM folder calibrated layer by layer (GPTQ, AWQ, SmoothQuant:
lm_methods.py), resumable, with its perplexity.

The side effects around engine/lm/sequential.py: reading one decoder layer's tensors at a time
from the folder's safetensors, keeping each finished layer on disk beside the destination
(`<destination>.qmill-calibration/`) so a killed run resumes at the last finished layer, and
reporting progress. What it produces is one LeafResult per calibrated linear (and, for AWQ and
SmoothQuant, the norms and biases their folds changed); the checkpoint pipeline then writes the
output from them (backends.Precomputed, the folded tensors in place of the source's), every
other tensor as the recipe says, so the output is the same folder as a round-to-nearest run's, in
any format.

Memory: one layer's weights (float32), the calibration and evaluation hidden states, one
stage's Hessian and input: `estimate` says how much, before any work.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from qmill.checkpoints.formats.hf_folder import folder as hf_folder
from qmill.checkpoints.formats.safetensors import source as safetensors_source
from qmill.checkpoints.lm import methods as lm_methods
from qmill.checkpoints.lm import plans as lm_plans
from qmill.checkpoints.lm import work as lm_work
from qmill.checkpoints.run import embedded

SUFFIX = ".qmill-calibration"
METHODS = lm_methods.METHODS


@dataclasses.dataclass(frozen=True, kw_only=True)
class LmRequest:
    """What to calibrate with, and how."""

    # int32 (samples, tokens): the calibration windows.
    calibration_ids: np.ndarray
    # int32 (windows, tokens) of held-out text for the perplexity, or None for none.
    eval_ids: np.ndarray | None = None
    # GPTQ's options: columns per block, dampening fraction, activation order.
    blocksize: int = 128
    percdamp: float = 0.01
    actorder: bool = True
    # Samples run through a stage at once: bounds the intermediates (B, T, intermediate).
    # 4 is as fast as 8 or 16 on the 2-core VM (smaller score blocks stay in cache) and holds
    # half the temporaries of 8.
    chunk: int = 4
    # A mixture of experts: every token through every expert for the statistics (the layer's
    # output keeps the routed result).
    all_experts: bool = False
    # One of METHODS (lm_methods.py, docs/calibrated-methods.md).
    method: str = "gptq"
    # SmoothQuant's migration strength α (llm-compressor's smoothing_strength).
    smoothquant_alpha: float = 0.5
    # AWQ's grid points over the ratio (llm-compressor's n_grid).
    awq_grid: int = 20
    # --method awq: clip the weights before round to nearest (engine/lm/awq_clip.py).
    awq_clip: bool = True
    # --method qep: how far each weight moves towards its input's error (engine/lm/qep.py's α).
    qep_correction: float = 0.5
    # --method hadamard[+gptq]: the seed of the rotation's random signs (engine/lm/rotation.py).
    hadamard_seed: int = 0

    def __post_init__(self) -> None:
        lm_methods.check(self)


@dataclasses.dataclass(frozen=True)
class LayerProgress:
    """One finished decoder layer, for progress lines and job progress."""

    layer: int
    layers: int
    loss: float
    seconds: float
    eta_seconds: float
    resumed: bool = False


@dataclasses.dataclass(frozen=True)
class LmOutcome:
    """What the calibration gave: the calibrated linears' results live in `directory`."""

    directory: pathlib.Path
    # Full tensor name → method ("gptq", "awq", "awq+gptq", ...; "rtn" for an expert no token
    # reached or a linear no fold scaled) for every linear the calibration quantized.
    methods: dict[str, str]
    # One {"layer", "loss", "seconds", "losses": {name: loss}} per decoder layer.
    layers: list[dict[str, Any]]
    # {"source": ppl, "quantized": ppl} or None without evaluation windows.
    perplexity: dict[str, float] | None
    # Full tensor name → why it was quantized round to nearest (an expert no token reached).
    rtn: dict[str, str] = dataclasses.field(default_factory=dict)
    # Tensor name → a loader of a float tensor AWQ / SmoothQuant changed (a norm, a bias), which
    # the output holds in place of the source's (pipeline.quantize_checkpoint's `replaced`).
    folded: dict[str, Callable[[], np.ndarray]] = dataclasses.field(default_factory=dict)
    # The request's method (METHODS).
    method: str = "gptq"


def work_directory(destination: str | os.PathLike) -> pathlib.Path:
    dest = pathlib.Path(destination).absolute()
    return dest.with_name(dest.name + SUFFIX)


def model_config(folder: str | os.PathLike) -> Any:
    """The folder's LmConfig (engine/lm/config.py), refused before any work if unsupported.

    Raises:
      ValueError: not a Hugging Face folder, or an architecture the forward pass lacks.
    """
    from qmill.engine.lm import config as config_lib

    path = pathlib.Path(folder)
    if not path.is_dir() or not (path / hf_folder.CONFIG).is_file():
        raise ValueError(
            f"{folder}: calibrating a language model takes a Hugging Face model folder "
            "(config.json + safetensors weights)"
        )
    return config_lib.from_hf_config(hf_folder.read_config(path))


def _open_weights(folder: pathlib.Path) -> safetensors_source.SafetensorsSource:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return safetensors_source.open_index(index)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no safetensors weights")
    return safetensors_source.SafetensorsSource(files)


def _fingerprint(folder: pathlib.Path, recipe: Mapping[str, Any], request: LmRequest) -> dict:
    sizes = sorted((p.name, p.stat().st_size) for p in folder.glob("*.safetensors"))
    return {
        "source": str(folder.absolute()),
        "weights": sizes,
        "recipe": lm_work.canonical_recipe(recipe),
        "tokens": lm_work.tokens_digest(request.calibration_ids, request.eval_ids),
        "gptq": [request.blocksize, request.percdamp, request.actorder, request.chunk]
        + ([True] if request.all_experts else []),
        **lm_methods.fingerprint(request),
    }


def calibrate(
    folder: str | os.PathLike,
    destination: str | os.PathLike,
    recipe: Mapping[str, Any],
    request: LmRequest,
    *,
    restart: bool = False,
    progress: Callable[[LayerProgress], None] | None = None,
    check: Callable[[], None] | None = None,
    notice: Callable[[str], None] | None = None,
) -> LmOutcome:
    """Calibrates the folder's decoder layers one at a time (engine/lm/sequential.py).

    Resumable: each finished layer is kept in `<destination>.qmill-calibration/` with the
    hidden states after it, so a call with the same arguments after an interruption starts at
    the next layer and gives the same bytes; `restart` discards it, and so does another qmill
    version (saying so to `notice`: lm_work.Work). `check` is called before each layer (a
    cancelled job raises there).

    Raises:
      ValueError: an unsupported architecture, missing tensors, token ids outside the
        vocabulary, or kept work made with other arguments (pass restart).
    """
    lm_methods.check_recipe(request.method, recipe)
    embedded.load_engine()
    _free_large_blocks_at_once()
    folder = pathlib.Path(folder)
    cfg = model_config(folder)
    _check_ids(cfg, request)
    lm_methods.check_model(request.method, cfg)
    calibrate_layer = lm_methods.layer_calibrator(request)
    # The served model's forward pass (the evaluation's): dynamic input quantization.
    quantized_cfg = lm_methods.quantized_config(cfg, recipe)
    fingerprint = _fingerprint(folder, recipe, request)
    work = lm_work.Work(work_directory(destination), fingerprint, restart, notice=notice)
    with work, _open_weights(folder) as weights:
        entries = {e.path: tuple(e.shape) for e in weights.entries()}
        _check_tensors(cfg, entries)
        untie = lm_methods.untie(request.method, cfg)  # Hadamard: a tied head untied
        plans = lm_plans.for_calibration(weights, folder, destination, recipe, untie)
        outer = _outer(cfg, weights)
        run_outer = lm_methods.outer_as_run(request, cfg, outer)  # Hadamard: rotated
        streams = work.resume() or _start(cfg, outer, run_outer, plans, request)
        # Hadamard: the rotated embedding, norm and head, kept with layer 0's results.
        first = lm_methods.outer_folded(request, cfg, run_outer) if not streams.next_layer else {}
        if streams.source is None:
            outer = run_outer = None  # the embedding (and head): only the evaluation's now
        started = time.monotonic()
        for layer in range(streams.next_layer, cfg.num_layers):
            if check is not None:
                check()
            t0 = time.monotonic()
            done = _one_layer(cfg, quantized_cfg, layer, weights, plans, streams, calibrate_layer)
            if first:
                done, first = dataclasses.replace(done, folded={**first, **done.folded}), {}
            seconds = time.monotonic() - t0
            work.finish_layer(layer, done, seconds, streams)
            if progress is not None:
                finished = layer + 1 - work.resumed_at
                eta = (time.monotonic() - started) / finished * (cfg.num_layers - layer - 1)
                loss = lm_work.layer_loss(done)
                progress(LayerProgress(layer, cfg.num_layers, loss, seconds, eta))
            # done.hidden is the next layer's input: held here, it would outlive take_hidden.
            del done
        run_cfg = lm_methods.run_config(request, cfg)  # Hadamard: its head untied
        perplexity = _perplexity(cfg, run_cfg, plans, outer, run_outer, streams)
    return LmOutcome(
        work.directory,
        work.methods(),
        work.layers(),
        perplexity,
        rtn=work.rtn(),
        folded=lm_work.folded_of(work.directory),
        method=request.method,
    )


def _one_layer(cfg, quantized_cfg, layer, weights, plans, streams, calibrate_layer) -> Any:
    """Calibrates decoder layer `layer` on the streams' hidden states and moves the streams
    (calibration, and the evaluation's source and quantized ones) past it."""
    from qmill.engine.lm import config as config_lib
    from qmill.engine.lm import sequential

    prefix = config_lib.layer_prefix(cfg, layer)
    tensors = {
        n.removeprefix(prefix): weights.read(n) for n in config_lib.layer_tensor_names(cfg, layer)
    }
    # QEP's float stream, given up here as the calibration's is (take_hidden).
    extra = {} if streams.reference is None else {"reference": streams.take_reference()}
    done = calibrate_layer(
        cfg, layer, tensors, streams.take_hidden(), plans.linears(cfg, layer, prefix), **extra
    )
    check_scales(done.results)
    if streams.source is not None:
        streams.source = sequential.run_layer(cfg, layer, tensors, streams.source)
        streams.quantized = sequential.run_layer(
            quantized_cfg, layer, done.weights, streams.quantized
        )
    streams.hidden, streams.next_layer = done.hidden, layer + 1
    streams.reference = done.reference
    return done


def _perplexity(
    cfg: Any, run_cfg: Any, plans: Any, outer: Any, run_outer: Any, streams: lm_work.Streams
) -> dict[str, float] | None:
    """The source's and the quantized model's perplexity on the evaluation tokens (None
    without them), from the streams the layers were run on."""
    from qmill.engine.lm import sequential

    if streams.source is None:
        return None
    quantized_outer = plans.outer_as_quantized(run_cfg, run_outer)
    return {
        "source": sequential.perplexity(cfg, outer, streams.source, streams.eval_ids),
        "quantized": sequential.perplexity(
            run_cfg, quantized_outer, streams.quantized, streams.eval_ids
        ),
    }


def check_scales(results: Mapping[str, Any]) -> None:
    """Refuses, before anything is kept or written, a result with a NaN, infinite, zero or
    negative scale (what an expert without calibration tokens gets from other trackers).

    Raises:
      ValueError: naming the tensor.
    """
    for name, result in results.items():
        scale = np.asarray(result.scale).astype(np.float32)
        if not np.all(np.isfinite(scale)) or not np.all(scale > 0):
            bad = int(np.sum(~(np.isfinite(scale) & (scale > 0))))
            raise ValueError(
                f"{name}: {bad} of its {scale.size} scales are NaN, infinite or not positive; "
                "nothing was written (report this: the calibration should not produce them)"
            )


def _free_large_blocks_at_once() -> None:
    """glibc: blocks of 4 MiB and more get their own mapping, unmapped when freed. By default
    glibc raises that threshold (up to 32 MiB) each time such a block is freed, after which
    the stages' per-chunk temporaries (5-40 MB, made and freed at every stage) are carved from
    its heaps and stay resident, fragmented: ~200 MB more at 64 x 512 tokens
    (bench/lm_layer_profile.py, the CLI's peak RSS). Process-wide; elsewhere a no-op."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 4 << 20)
    except (OSError, AttributeError):  # another C library (musl has no mallopt)
        return


_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def discard(destination: str | os.PathLike) -> None:
    """Removes the kept calibration (after the output is committed)."""
    shutil.rmtree(work_directory(destination), ignore_errors=True)


def _check_ids(cfg: Any, request: LmRequest) -> None:
    for what, ids in (("calibration", request.calibration_ids), ("evaluation", request.eval_ids)):
        if ids is None:
            continue
        if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] < 2:
            raise ValueError(
                f"the {what} token ids must be int (samples, tokens) with at least one sample "
                f"of 2 tokens, got shape {ids.shape}"
            )
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"the {what} token ids must be integers, got {ids.dtype}")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= cfg.vocab_size:
            raise ValueError(
                f"the {what} token ids range over [{low}, {high}], outside the model's "
                f"vocabulary of {cfg.vocab_size}: were they made with this model's tokenizer?"
            )


def _check_tensors(cfg: Any, entries: Mapping[str, tuple[int, ...]]) -> None:
    from qmill.engine.lm import config as config_lib

    wanted = [n for n in config_lib.outer_tensor_names(cfg).values() if n]
    for layer in range(cfg.num_layers):
        wanted += config_lib.layer_tensor_names(cfg, layer)
    missing = [n for n in wanted if n not in entries]
    if missing:
        raise ValueError(
            f"the folder's weights lack {len(missing)} tensor(s) its config.json implies, e.g. "
            f"{', '.join(missing[:3])}; is config.json this checkpoint's?"
        )


def _outer(cfg: Any, weights: Any) -> dict[str, Any]:
    import jax.numpy as jnp

    from qmill.engine.lm import config as config_lib

    names = config_lib.outer_tensor_names(cfg)
    return {key: jnp.asarray(weights.read(name)) for key, name in names.items() if name}


def _start(
    cfg: Any, outer: Mapping[str, Any], run_outer: Any, plans: lm_plans.Plans, request: LmRequest
) -> lm_work.Streams:
    from qmill.engine.lm import sequential

    quantized_outer = plans.outer_as_quantized(cfg, run_outer)
    calibration = sequential.split(request.calibration_ids.astype(np.int32), request.chunk)
    streams = lm_work.Streams(0, sequential.embed(cfg, quantized_outer, calibration))
    if lm_methods.propagates_float(request.method):
        streams.reference = sequential.embed(cfg, outer, calibration)
    if request.eval_ids is not None:
        ids = sequential.split(request.eval_ids.astype(np.int32), request.chunk)
        streams.eval_ids = ids
        streams.source = sequential.embed(cfg, outer, ids)
        streams.quantized = sequential.embed(cfg, quantized_outer, ids)
    return streams


def tensor_shapes(folder: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape of the folder's weights (headers only)."""
    with _open_weights(pathlib.Path(folder)) as weights:
        return {e.path: tuple(e.shape) for e in weights.entries()}


def check_request(
    folder: str | os.PathLike, request: LmRequest, recipe: Mapping[str, Any] | None = None
) -> Any:
    """What `calibrate` refuses before any work, checked without doing any (a server checks a
    job's request when it is submitted): the folder's LmConfig. `recipe`: the one the method
    calibrates (lm_methods.check_recipe); None for a run without a method (static ranges).

    Raises:
      ValueError: a recipe the method cannot calibrate, an unsupported architecture, missing
        tensors, token ids of a bad shape or outside the vocabulary, or all_experts for a
        model without experts.
    """
    if recipe is not None:
        lm_methods.check_recipe(request.method, recipe)
    cfg = model_config(folder)
    _check_ids(cfg, request)
    lm_methods.check_model(request.method, cfg)
    if request.all_experts and cfg.moe is None:
        # Accepting it would fingerprint the kept work with an option that changed nothing.
        raise ValueError(
            f"--calibrate-all-experts is for a mixture of experts (Mixtral, Qwen2/3-MoE); this "
            f"{cfg.model_type} model has no experts: leave the option out"
        )
    with _open_weights(pathlib.Path(folder)) as weights:
        _check_tensors(cfg, {e.path: tuple(e.shape) for e in weights.entries()})
    return cfg


def report_fields(request: LmRequest, done: LmOutcome) -> dict[str, Any]:
    """A calibration's report: the perplexity, each layer's losses (and folds) and the options
    (what `--report-json` adds, and a job's calibration_report_json)."""
    calibration: dict[str, Any] = {
        "method": request.method,
        "samples": int(request.calibration_ids.shape[0]),
        "seq_len": int(request.calibration_ids.shape[1]),
        "eval_windows": None if request.eval_ids is None else int(request.eval_ids.shape[0]),
        "calibrate_all_experts": request.all_experts,
        "round_to_nearest": done.rtn,
    }
    calibration.update(lm_methods.report_options(request, done.methods))
    return {"perplexity": done.perplexity, "calibration": {**calibration, "layers": done.layers}}
