"""`qmill submit FOLDER DEST --method gptq|awq|... ...`: a language-model calibration as a job's
request.

The flags are `qmill quantize`'s (calibrated_lm.add_arguments); the client makes the token
windows (the folder's tokenizer.json, or the --*-ids files) and sends them inside the
SubmitJobRequest (pb.LanguageModelCalibration); the server calibrates and writes the output as
`qmill quantize --method gptq` does in process, the same bytes.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

from qmill.checkpoints.lm import calibration as lm_calibration
from qmill.checkpoints.lm import methods as lm_methods
from qmill.cli import calibrated_lm
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb

SUBMIT_HELP = (
    "A job reads SOURCE and writes DESTINATION on the server's filesystem. With --method gptq "
    "(SOURCE a Hugging Face causal-LM folder) the server calibrates it layer by layer, the job's "
    "progress saying layer i/N with its GPTQ loss and ETA; --calibration-text / --eval-text are "
    "tokenized here with SOURCE/tokenizer.json, read at the path you give: the server's path "
    "too when client and server share one host (otherwise pass --calibration-ids / --eval-ids)"
)


def message(
    request: lm_calibration.LmRequest, max_ppl_increase: float | None = None
) -> pb.LanguageModelCalibration:
    """The wire form of a calibration request."""
    out = pb.LanguageModelCalibration(
        method=request.method,
        calibration_ids=_inline("calibration_ids", request.calibration_ids),
        gptq_block_size=request.blocksize,
        gptq_dampening=request.percdamp,
        gptq_actorder="static" if request.actorder else "none",
    )
    if request.method != "gptq":  # a GPTQ request stays the message it was (its server id)
        out.smoothquant_alpha = request.smoothquant_alpha
        out.awq_grid = request.awq_grid
        out.awq_no_clip = not request.awq_clip  # false (the default) is not on the wire
    if request.method == "qep":
        out.qep_correction = request.qep_correction
    if lm_methods.rotates(request.method):
        out.hadamard_seed = request.hadamard_seed
    # A proto3 bool: false is not on the wire, so a request without it keeps its server id.
    out.calibrate_all_experts = request.all_experts
    if request.eval_ids is not None:
        out.eval_ids.CopyFrom(_inline("eval_ids", request.eval_ids))
    if max_ppl_increase is not None:
        out.max_ppl_increase = max_ppl_increase
    return out


def _inline(path: str, ids: np.ndarray) -> pb.InlineTensor:
    array = np.ascontiguousarray(ids, np.int32)
    data = wire.to_bytes(array)
    return pb.InlineTensor(header=wire.header_for(path, array, data), data=data.tobytes())


def from_args(args: argparse.Namespace, print_line) -> pb.LanguageModelCalibration | None:
    """The calibration `qmill submit`'s flags ask for, or None without --method.

    Raises:
      ValueError: half-given flags, unreadable ids or text, or an estimate over --max-memory.
    """
    # The flags' rules are quantize's, less what only quantize has (--calibration, --server).
    checked = argparse.Namespace(**{**vars(args), "calibration": None, "server": None})
    if not calibrated_lm.wanted(checked):
        return None
    request = calibrated_lm.request(args)
    if pathlib.Path(args.source, "config.json").is_file():  # the folder is readable here
        for line in calibrated_lm.check_memory(args, request):
            print_line(line)
    elif args.max_memory is not None:
        raise ValueError(
            f"--max-memory estimates from {args.source}/config.json, which is not readable here; "
            "drop --max-memory or run on the server's host"
        )
    return message(request, args.max_ppl_increase)
