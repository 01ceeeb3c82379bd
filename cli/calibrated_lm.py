"""`qmill quantize FOLDER --method gptq|awq|awq+gptq|smoothquant|smoothquant+gptq|qep|hadamard|
hadamard+gptq`: a Hugging Face causal LM calibrated layer by layer.

The command's side: its flags, the token windows (the folder's own tokenizer.json, read with
the `tokenizers` library: Rust, no torch), the memory estimate and `--max-memory`, progress
lines, and the perplexity gate (`--max-ppl-increase`), checked before anything is written under
the output's name. The calibration itself is checkpoints/lm_calibration.py.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from qmill.checkpoints.lm import calibration as lm_calibration
from qmill.checkpoints.lm import memory as lm_memory
from qmill.checkpoints.lm import methods as lm_methods
from qmill.cli import report

METHODS = lm_calibration.METHODS
# How the report names each method (a calibrated linear's row), as for a --calibration run.
METHOD_NAMES = {
    "gptq": "GPTQ",
    "rtn": "RTN",
    "awq": "AWQ",
    "awq+gptq": "AWQ+GPTQ",
    "smoothquant": "SmoothQuant",
    "smoothquant+gptq": "SmoothQuant+GPTQ",
    "qep": "QEP+GPTQ",
    "hadamard": "Hadamard",
    "hadamard+gptq": "Hadamard+GPTQ",
}
DEFAULT_SAMPLES = 64
DEFAULT_SEQ_LEN = 512
DEFAULT_EVAL_SAMPLES = 32
_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?)(i?)b?\s*$", re.I)


def add_arguments(q: argparse.ArgumentParser) -> None:
    """The flags of a calibrated language-model run on `qmill quantize`."""
    g = q.add_argument_group(
        "calibrated language models",
        "a Hugging Face causal-LM folder: Llama, Mistral, Qwen2/3, Phi-3, Gemma 1/2/3, "
        "Mixtral, Qwen2-MoE, Qwen3-MoE",
    )
    g.add_argument(
        "--method",
        choices=METHODS,
        # The choices are in the help; as a metavar they overflow the usage line's 80 columns.
        metavar="METHOD",
        help=f"{', '.join(METHODS)}: "
        "calibrate the folder's linear layers with this method, layer by layer, on "
        "--calibration-text or --calibration-ids (the output is the recipe's format): GPTQ; AWQ "
        "or SmoothQuant scales folded into the norms and linears before them, then round to "
        "nearest (AWQ: weights clipped first, as the paper), or GPTQ with +gptq "
        "(docs/calibrated-methods.md); QEP: each weight corrected for the error the quantized "
        "layers before it put into its input, then GPTQ (dense models); Hadamard: the "
        "residual stream rotated by a Hadamard matrix fused into the weights (the output loads "
        "as the same architecture), then round to nearest, or GPTQ with +gptq (dense models "
        "with an untied head)",
    )
    _add_windows(
        g,
        "calibration",
        "text to calibrate on (UTF-8)",
        "token ids to calibrate on instead: int (samples, tokens), made with the folder's "
        "tokenizer",
        (
            DEFAULT_SAMPLES,
            "windows cut from --calibration-text (default %(default)s; a GPU takes 256+)",
        ),
    )
    g.add_argument(
        "--calibration-seq-len",
        type=int,
        default=DEFAULT_SEQ_LEN,
        help="tokens per window, calibration and evaluation (default %(default)s)",
    )
    _add_windows(
        g,
        "eval",
        "held-out text: the perplexity of the source and the quantized model on it is printed "
        "and in --report-json",
        "held-out token ids instead",
        (DEFAULT_EVAL_SAMPLES, "at most this many windows of --eval-text (default %(default)s)"),
    )
    g.add_argument(
        "--max-ppl-increase",
        type=float,
        metavar="PCT",
        help="refuse the output (nothing written under its name, exit 1) when the quantized "
        "model's perplexity exceeds the source's by more than PCT percent; needs --eval-*",
    )
    g.add_argument(
        "--max-memory",
        metavar="SIZE",
        help="refuse before any work a calibration whose estimated peak exceeds SIZE (e.g. "
        "8GiB); --dry-run prints the estimate",
    )
    _add_method_options(g)


def _add_windows(g: Any, name: str, text: str, ids: str, samples: tuple[int, str]) -> None:
    """--NAME-text, --NAME-ids and --NAME-samples: the calibration's or the evaluation's token
    windows, as text (cut with the folder's tokenizer, `_windows_of`) or as ids; `samples`: the
    windows' default count and its help."""
    g.add_argument(f"--{name}-text", metavar="FILE", help=text)
    g.add_argument(f"--{name}-ids", metavar="IDS.npy", help=ids)
    g.add_argument(f"--{name}-samples", type=int, default=samples[0], help=samples[1])


def _add_method_options(g: Any) -> None:
    """The methods' own options: experts' statistics, GPTQ's, SmoothQuant's and AWQ's."""
    g.add_argument(
        "--calibrate-all-experts",
        action="store_true",
        help="mixtures of experts: every calibration token through every expert for its "
        "statistics (the layer's output keeps the routed result), so that no expert is left "
        "without tokens; by default an expert sees the tokens routed to it, and one that gets "
        "none is quantized round to nearest and named in the report",
    )
    g.add_argument("--gptq-block-size", type=int, default=128, help="GPTQ columns per block (128)")
    g.add_argument(
        "--gptq-dampening",
        type=float,
        default=0.01,
        help="fraction of the Hessian's mean diagonal added to it (0.01)",
    )
    g.add_argument(
        "--gptq-actorder",
        choices=("static", "none"),
        default="static",
        help="static (default): columns by descending activation, group scales fixed first "
        "(the GPTQ paper's act-order, llm-compressor's default); none: in order",
    )
    g.add_argument(
        "--smoothquant-alpha",
        type=float,
        default=0.5,
        help="SmoothQuant's migration strength α in [0, 1] (0.5, llm-compressor's default)",
    )
    g.add_argument(
        "--awq-grid",
        type=int,
        default=20,
        help="AWQ's grid points over the scale's ratio (20, llm-compressor's default)",
    )
    g.add_argument(
        "--qep-correction",
        type=float,
        default=None,
        metavar="ALPHA",
        help="--method qep: how far each weight moves towards compensating its input's error, "
        "in [0, 1] (0.5, the QEP paper's; 0: plain GPTQ on the quantized model's inputs)",
    )
    g.add_argument(
        "--no-awq-clip",
        dest="awq_clip",
        action="store_false",
        help="--method awq without clipping the weights before round to nearest (the scales "
        "only, as llm-compressor's AWQ; default: clipped, as the AWQ paper)",
    )
    g.add_argument(
        "--hadamard-seed",
        type=int,
        default=None,
        metavar="SEED",
        help="--method hadamard[+gptq]: the seed of the rotation's random signs, in [0, 2^32) "
        "(0; the same seed gives the same bytes)",
    )


def calibrates(args: argparse.Namespace) -> bool:
    """Whether the run calibrates a language model: --method, or the calibration tokens of a
    static-activation scheme (others are refused: `wanted`, static_activations)."""
    flags = ("method", "calibration_text", "calibration_ids")
    return any(getattr(args, f, None) is not None for f in flags)


def wanted(args: argparse.Namespace) -> bool:
    """Whether the run calibrates a language model; refuses half-given flags."""
    if getattr(args, "qep_correction", None) is not None and args.method != "qep":
        raise ValueError(
            "--qep-correction is --method qep's; this run's method "
            f"({args.method or 'none'}) corrects nothing: drop the flag or add --method qep"
        )
    if getattr(args, "hadamard_seed", None) is not None and not lm_methods.rotates(
        args.method or ""
    ):
        raise ValueError(
            "--hadamard-seed is --method hadamard's (and hadamard+gptq's); this run's method "
            f"({args.method or 'none'}) rotates nothing: drop the flag"
        )
    if not getattr(args, "awq_clip", True) and args.method != "awq":
        raise ValueError(
            "--no-awq-clip turns off the weight clipping of --method awq (by round to nearest); "
            f"this run's method ({args.method or 'none'}) clips nothing: drop the flag"
        )
    lm_flags = ("calibration_text", "calibration_ids", "eval_text", "eval_ids", "max_ppl_increase")
    given = [f for f in lm_flags if getattr(args, f, None) is not None]
    if args.method is None:
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ValueError(f"{flag} calibrates a language model: add --method gptq")
        if getattr(args, "calibrate_all_experts", False):
            raise ValueError(
                "--calibrate-all-experts changes a calibration's statistics, and this run "
                "calibrates nothing: add --method gptq (or awq, smoothquant, ...) with "
                "--calibration-text, or use a static-activation scheme (FP8, NVFP4)"
            )
        return False
    if (args.calibration_text is None) == (args.calibration_ids is None):
        raise ValueError(
            f"--method {args.method} takes one of --calibration-text or --calibration-ids"
        )
    if args.calibration is not None:
        raise ValueError("--method calibrates the model itself: drop --calibration")
    if args.max_ppl_increase is not None and args.eval_text is None and args.eval_ids is None:
        raise ValueError("--max-ppl-increase needs --eval-text or --eval-ids")
    for flag in ("calibration_samples", "calibration_seq_len", "eval_samples"):
        if getattr(args, flag) < 1 or (
            flag == "calibration_seq_len" and args.calibration_seq_len < 2
        ):
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1 (2 for a length)")
    return True


def untie(args: argparse.Namespace) -> tuple[str, str] | None:
    """(head, embedding) of the source's tied head, which the output of a rotating --method
    holds as a tensor of its own (lm_methods.untie), or None."""
    method = getattr(args, "method", None)
    if method is None or not lm_methods.rotates(method):
        return None
    return lm_methods.untie(method, lm_calibration.model_config(args.source))


def parse_size(text: str) -> int:
    """'8GiB', '500MB', '1.5G', '1000000' as bytes.

    Raises:
      ValueError: not a size.
    """
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"--max-memory {text!r} is not a size such as 8GiB or 500MB")
    power = " kmgt".index(m.group(2).lower() or " ")
    base = 1024 if m.group(3) or not m.group(2) else 1000
    return int(float(m.group(1)) * base**power)


def windows(folder: str, text_path: str, count: int, length: int, what: str) -> np.ndarray:
    """Up to `count` non-overlapping windows of `length` tokens from the start of a text file,
    tokenized with the folder's tokenizer.json.

    Raises:
      ValueError: no tokenizer.json, an unreadable text, or too little text for one window.
    """
    from tokenizers import Tokenizer

    tokenizer_file = pathlib.Path(folder) / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(
            f"{folder} has no tokenizer.json to tokenize {text_path} with; pass token ids "
            "(--calibration-ids / --eval-ids) instead"
        )
    try:
        text = pathlib.Path(text_path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read {what} text {text_path}: {e}") from None
    ids = np.asarray(Tokenizer.from_file(str(tokenizer_file)).encode(text).ids, np.int32)
    available = len(ids) // length
    if available == 0:
        raise ValueError(
            f"{text_path} holds {len(ids)} tokens, fewer than one window of {length}: give more "
            "text or a shorter --calibration-seq-len"
        )
    if available < count:
        print(
            f"qmill: {text_path} holds {available} windows of {length} tokens, not {count}: "
            f"using {available}",
            file=sys.stderr,
        )
    n = min(count, available)
    return ids[: n * length].reshape(n, length)


def _ids_file(path: str, what: str) -> np.ndarray:
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {what} ids {path}: {e}") from None
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"{path}: {what} ids must be an integer array (samples, tokens), got {ids.dtype} "
            f"of shape {ids.shape}"
        )
    return ids.astype(np.int32)


def request(args: argparse.Namespace) -> lm_calibration.LmRequest:
    """The token windows and GPTQ options the flags ask for."""
    return lm_calibration.LmRequest(
        calibration_ids=calibration_ids(args),
        eval_ids=_windows_of(args, "eval", "evaluation"),
        blocksize=args.gptq_block_size,
        percdamp=args.gptq_dampening,
        actorder=args.gptq_actorder == "static",
        method=args.method,
        smoothquant_alpha=args.smoothquant_alpha,
        awq_grid=args.awq_grid,
        awq_clip=args.awq_clip,
        qep_correction=0.5 if args.qep_correction is None else args.qep_correction,
        hadamard_seed=args.hadamard_seed or 0,
        all_experts=args.calibrate_all_experts,
    )


def calibration_ids(args: argparse.Namespace) -> np.ndarray:
    """The calibration token windows the flags ask for (--calibration-ids, or the text cut
    into --calibration-samples windows of --calibration-seq-len tokens)."""
    return _windows_of(args, "calibration", "calibration")


def _windows_of(args: argparse.Namespace, name: str, what: str) -> Any:
    """The token windows --NAME-ids holds, or --NAME-text cut into at most --NAME-samples
    windows of --calibration-seq-len tokens; None without either."""
    ids, text = getattr(args, f"{name}_ids"), getattr(args, f"{name}_text")
    if ids is not None:
        return _ids_file(ids, what)
    if text is None:
        return None
    count = getattr(args, f"{name}_samples")
    return windows(args.source, text, count, args.calibration_seq_len, what)


def check_memory(args: argparse.Namespace, req: lm_calibration.LmRequest) -> list[str]:
    """The estimate's lines; refuses the run when it exceeds --max-memory."""
    cfg = lm_calibration.model_config(args.source)
    parts = lm_memory.estimate(cfg, lm_calibration.tensor_shapes(args.source), req)
    total = sum(parts.values())
    lines = [
        f"calibration memory estimate: {report.size_text(total)} at its peak "
        + "("
        + ", ".join(f"{k} {report.size_text(v)}" for k, v in parts.items())
        + f"; {cfg.num_layers} layers, {req.calibration_ids.shape[0]} × "
        f"{req.calibration_ids.shape[1]} calibration tokens)"
    ]
    if args.max_memory is not None and total > (limit := parse_size(args.max_memory)):
        raise ValueError(
            f"the calibration needs about {report.size_text(total)}, more than --max-memory "
            f"{args.max_memory} ({report.size_text(limit)}): use fewer --calibration-samples or a "
            "shorter --calibration-seq-len"
        )
    return lines


def calibrate(
    args: argparse.Namespace, recipe: dict[str, Any], req: lm_calibration.LmRequest
) -> lm_calibration.LmOutcome:
    """Runs the calibration with progress lines on stderr, and the perplexity gate."""
    quiet = args.quiet

    def progress(p: lm_calibration.LayerProgress) -> None:
        if not quiet:
            print(progress_line(args.method, p), file=sys.stderr, flush=True)

    done = lm_calibration.calibrate(
        args.source,
        args.output,
        recipe,
        req,
        restart=args.restart,
        progress=progress,
        notice=notice(args),
    )
    gate(
        args,
        done.perplexity,
        "the calibration is kept beside it; rerun with other settings or --restart",
    )
    return done


def notice(args: argparse.Namespace) -> Callable[[str], None]:
    """Where the kept work's one line goes (lm_work.Work: kept by another qmill, started
    over): stderr beside the progress lines, which --quiet silences too."""

    def say(line: str) -> None:
        if not args.quiet:
            print(f"qmill: {line}", file=sys.stderr, flush=True)

    return say


def gate(args: argparse.Namespace, ppl: dict[str, float] | None, kept: str) -> None:
    """The perplexity line, and --max-ppl-increase: raises (nothing written) when the quantized
    model lost more; `kept` says where the calibration waits for a rerun."""
    if ppl is None:
        return
    increase = 100 * (ppl["quantized"] / ppl["source"] - 1)
    if not args.quiet:
        print(
            f"qmill: perplexity {ppl['source']:.4g} (source) → {ppl['quantized']:.4g} "
            f"(quantized), {increase:+.2f} %",
            file=sys.stderr,
            flush=True,
        )
    if args.max_ppl_increase is not None and (
        math.isnan(increase) or increase > args.max_ppl_increase
    ):
        raise ValueError(
            f"the quantized model's perplexity is {increase:+.2f} % over the source's "
            f"({ppl['source']:.4g} → {ppl['quantized']:.4g}), more than --max-ppl-increase "
            f"{args.max_ppl_increase:g} %: nothing was written to {args.output} ({kept})"
        )


def progress_line(method: str, p: Any) -> str:
    """One finished layer ("qmill: layer 3/30: GPTQ loss 0.012, 4.1 s, ETA 110 s"): GPTQ's loss,
    AWQ's block-output error without GPTQ, no number for SmoothQuant alone."""
    return "qmill: " + lm_methods.layer_line(
        method, p.layer, p.layers, p.loss, p.seconds, p.eta_seconds
    )


def method_of(row: Any, calibrated: Mapping[str, str]) -> str:
    """A report row's method, as for a --calibration run: the calibrated linears' (GPTQ, AWQ,
    AWQ+GPTQ, SmoothQuant, SmoothQuant+GPTQ; RTN for one no fold scaled, and for experts no
    token reached: the report's calibration.round_to_nearest says why), RTN for what else the
    recipe quantized, "" for what it kept."""
    if row.path in calibrated:
        return METHOD_NAMES[calibrated[row.path]]
    return "" if row.qtype == "kept" else "RTN"


def report_fields(req: lm_calibration.LmRequest, done: lm_calibration.LmOutcome) -> dict:
    """What --report-json adds: the perplexity, each layer's GPTQ losses, the options."""
    return lm_calibration.report_fields(req, done)
