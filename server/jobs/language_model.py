"""Jobs that calibrate a Hugging Face causal-LM folder before writing it
(SubmitJobRequest.language_model): `qmill quantize FOLDER --method gptq` run by the server.

The job runs the CLI's own code: checkpoints/lm/calibration.py calibrates the decoder layers one
at a time, keeping each finished layer in `<destination>.qmill-calibration/`, then the checkpoint
pipeline writes the output with the calibrated linears' results (`Precomputed`) and the embedded
engine for every other tensor. That is what makes the output the in-process run's, byte for
byte, and what makes the job resumable: a job queued again after a restart (or handed back by a
stopping server) starts at the layer after the last one kept.

Progress goes to the job's message ("layer 3/30: GPTQ loss 0.012, 4.1 s, ETA 110 s"), which
WatchJob streams; the calibration's report (perplexity, each layer's losses) to the job's
calibration_report_json as soon as the calibration ends, and the perplexity to its final
message. The request is checked when it is submitted (`check_submit`): an unsupported
architecture, token ids outside the vocabulary or of a bad shape are INVALID_ARGUMENT then,
never a failed job later.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from qmill.checkpoints.lm import backends as lm_backends
from qmill.checkpoints.lm import calibration as lm_calibration
from qmill.checkpoints.lm import methods as lm_methods
from qmill.checkpoints.run import embedded
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import codec
from qmill.server.jobs import urls

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LmJob:
    """A job's calibration, as its stored SubmitJobRequest.language_model asks."""

    request: lm_calibration.LmRequest
    # Percent over the source's perplexity above which the job fails, writing nothing; or None.
    max_ppl_increase: float | None

    @classmethod
    def decode(cls, data: bytes) -> LmJob:
        message = pb.LanguageModelCalibration.FromString(data)
        return cls(*codec.lm_options(message))


def check_submit(
    message: pb.LanguageModelCalibration, source: str, recipe: Mapping[str, Any]
) -> bytes:
    """Checks a submitted calibration against its source folder and the job's recipe before any
    work; returns it serialized, as the job store keeps it.

    Raises:
      ValueError: bad ids or options, a recipe the method cannot calibrate, an object-store
        source, an unsupported architecture, or missing tensors.
    """
    request, _ = codec.lm_options(message)
    if urls.is_url(source):
        raise ValueError(
            "a language-model calibration job reads a folder on the server's filesystem, not an "
            f"object-store URL ({source}): copy the folder there first"
        )
    lm_calibration.check_request(source, request, recipe)
    return message.SerializeToString(deterministic=True)


def untie(job: LmJob, source: str) -> tuple[str, str] | None:
    """(head, embedding) of the source's tied head, which the output of a rotating method
    holds as a tensor of its own (lm_methods.untie: the in-process run's plan), or None."""
    return lm_methods.untie(job.request.method, lm_calibration.model_config(source))


def calibrate(
    job: LmJob,
    source: str,
    destination: str,
    recipe: dict[str, Any],
    *,
    check: Callable[[], None],
    update: Callable[..., object],
) -> lm_calibration.LmOutcome:
    """Calibrates (or resumes calibrating) the folder, with the job's progress and report.

    Raises:
      ValueError: the perplexity gate refused the model (the calibration is kept), or what
        lm_calibration.calibrate refuses.
    """

    first: list[int] = []

    def progress(p: lm_calibration.LayerProgress) -> None:
        if not first:
            first.append(p.layer)
        kept = f" (resumed after {first[0]} kept layers)" if first[0] else ""
        line = lm_methods.layer_line(
            job.request.method, p.layer, p.layers, p.loss, p.seconds, p.eta_seconds
        )
        update(message=line + kept)

    def notice(line: str) -> None:  # kept work of another qmill, started over
        log.info("%s", line)
        update(message=line)

    update(message="calibrating")
    done = lm_calibration.calibrate(
        source, destination, recipe, job.request, progress=progress, check=check, notice=notice
    )
    report = lm_calibration.report_fields(job.request, done)
    update(calibration_report_json=json.dumps(report), message="calibrated; writing the output")
    ppl = done.perplexity
    if job.max_ppl_increase is not None and ppl is not None:
        increase = _increase(ppl)
        if math.isnan(increase) or increase > job.max_ppl_increase:
            raise ValueError(
                f"the quantized model's perplexity is {increase:+.2f} % over the source's "
                f"({ppl['source']:.4g} → {ppl['quantized']:.4g}), more than max_ppl_increase "
                f"{job.max_ppl_increase:g} %: nothing was written (the calibration is kept "
                "beside the destination; submit again with other settings)"
            )
    return done


def backend(done: lm_calibration.LmOutcome) -> lm_backends.Precomputed:
    """The pipeline's backend: the calibrated linears' results, the embedded engine for the
    rest (whatever --job-peers says: the calibration ran here, and the rest is small)."""
    return lm_backends.Precomputed(embedded.EmbeddedClient(), done)


def summary(done: lm_calibration.LmOutcome) -> str:
    """What the job's final message adds: the perplexity and each layer's GPTQ loss."""
    parts = []
    if done.perplexity is not None:
        ppl = done.perplexity
        parts.append(
            f"perplexity {ppl['source']:.4g} (source) → {ppl['quantized']:.4g} (quantized), "
            f"{_increase(ppl):+.2f} %"
        )
    losses = ", ".join(f"{entry['loss']:.4g}" for entry in done.layers)
    if lm_methods.uses_gptq(done.method):
        parts.append(f"GPTQ loss by layer: {losses}")
    elif done.method == "awq":
        parts.append(f"AWQ output MSE by layer: {losses}")
    return "; " + "; ".join(parts)


def _increase(ppl: dict[str, float]) -> float:
    return 100 * (ppl["quantized"] / ppl["source"] - 1)
