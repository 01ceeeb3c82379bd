"""`qmill quantize FOLDER --server HOST:PORT --method gptq|awq|...`: the server calibrates the
language model; the client writes the output.

The client uploads the folder's weight files (Uploads: resumable, and a file the server already
holds is not sent again), then asks CalibrateLanguageModel with config.json, the recipe and the
token windows; the server runs the in-process calibration on its copy, one layer at a time,
streaming each layer's progress, and keeps the results under a calibration id. The checkpoint
pipeline then sends the tensors to QuantizeParams with that id as usual: the calibrated linears
come back as the server's kept results, every other tensor quantized as any other run's, and
the norms and biases AWQ / SmoothQuant folded their scales into (streamed before the summary)
are written in place of the source's, so the output is the in-process run's byte for byte. A
run cut short resumes: the uploads are whole already, and the same request finds the server's
kept layers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from qmill.checkpoints.lm import calibration as lm_calibration
from qmill.cli import calibrated_lm, lm_jobs
from qmill.client import errors, recipes
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb

_INDEX = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class Remote:
    """A calibration made on the server."""

    calibration_id: str
    # {"perplexity": ..., "calibration": {...}}: what --report-json adds.
    report: dict[str, Any]
    # The tensors QuantizeParams answers from the calibration → each one's method.
    methods: dict[str, str]
    # AWQ / SmoothQuant: name → a loader of a float tensor the folds changed (pipeline's
    # `replaced`).
    folded: dict[str, Callable[[], np.ndarray]] = dataclasses.field(default_factory=dict)

    def quantize_kwargs(self) -> dict[str, Any]:
        """What the backend's quantize calls carry: the calibration id."""
        return {"static_ranges": pb.StaticRanges(calibration_id=self.calibration_id)}


def weight_files(folder: str) -> list[pathlib.Path]:
    """The folder's safetensors files, as lm_calibration reads them."""
    path = pathlib.Path(folder)
    index = path / _INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no safetensors weights")
    return files


def check_server(args: argparse.Namespace) -> None:
    """The server side takes one server, one stream.

    Raises:
      ValueError: several servers or streams.
    """
    from qmill.client import fanout  # lazy: the gRPC client

    if fanout.is_fanout(args.server) or args.streams != 1:
        raise ValueError(f"--method {args.method} with --server takes one server (and --streams 1)")


def calibrate(
    client: Any,
    args: argparse.Namespace,
    recipe: dict[str, Any],
    request: lm_calibration.LmRequest,
) -> Remote:
    """Uploads the weights, has the server calibrate with progress lines on stderr, and applies
    the perplexity gate.

    Raises:
      ValueError: the quantized model's perplexity is over --max-ppl-increase.
      QmillError: what the server refused.
    """
    quiet = args.quiet
    uploads = {}
    for path in weight_files(args.source):
        if not quiet:
            print(f"qmill: uploading {path.name}", file=sys.stderr, flush=True)
        uploads[path.name] = client.upload(str(path)).upload_id
    folder = pathlib.Path(args.source)
    index = folder / _INDEX
    message = pb.CalibrateLanguageModelRequest(
        config_json=(folder / "config.json").read_text(),
        weight_uploads=uploads,
        index_json=index.read_text() if index.is_file() else "",
        recipe=recipes.message(recipe),
        calibration=lm_jobs.message(request),
    )

    def progress(p: pb.LanguageModelProgress) -> None:
        if not quiet:
            print(calibrated_lm.progress_line(args.method, p), file=sys.stderr, flush=True)

    folded: dict[str, np.ndarray] = {}

    def on_folded(tensor: pb.InlineTensor) -> None:
        folded[tensor.header.path] = _array(tensor)

    summary = client.calibrate_language_model(message, on_progress=progress, on_folded=on_folded)
    report = json.loads(summary.report_json)
    _gate(args, report["perplexity"])
    methods = report["calibration"].get("methods") or {}
    return Remote(
        summary.calibration_id,
        report,
        {name: methods.get(name, "gptq") for name in summary.calibrated_tensors},
        {name: (lambda a=array: a) for name, array in folded.items()},
    )


def _array(tensor: pb.InlineTensor) -> np.ndarray:
    """A folded tensor the server sent, checked against its header's crc32c."""
    header = tensor.header
    if header.crc32c != wire.crc32c(tensor.data):
        raise errors.QmillError("DATA_LOSS", f"{header.path}: crc32c mismatch; run again")
    return wire.from_bytes(tensor.data, header.dtype, tuple(header.shape))


def _gate(args: argparse.Namespace, ppl: dict[str, float] | None) -> None:
    """The perplexity line and --max-ppl-increase, as in process."""
    calibrated_lm.gate(
        args, ppl, "the calibration is kept on the server; rerun with other settings"
    )
