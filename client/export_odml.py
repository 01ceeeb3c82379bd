"""Client side of ExportOdml: ask a server for a LiteRT model, check it, write it atomically.

Also the `qmill export-odml` command: params from a checkpoint (uploaded, once) or an upload id.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from qmill.client import credentials, programs, uploads
from qmill.client.service_client import ServiceClient
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb

# Named rule sets for the CLI: weight-only int8 / int4, and static-range int8 (needs a calibration).
PRESETS: dict[str, list[pb.ModelRule]] = {
    "int8": [pb.ModelRule(weight_qtype="int8")],
    "int4": [pb.ModelRule(weight_qtype="int4")],
    "w8a8": [pb.ModelRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)],
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportResult:
    # Where the .tflite was written.
    path: pathlib.Path
    # The server's description of the model (ops, quantized weights by type).
    info: pb.OdmlModelInfo


class ModelReceiver:
    """Feeds on ExportOdml responses; `write()` puts the checked model under its name.

    The model's bytes arrive as one tensor would (the info announces their length and crc32c,
    chunks follow), so the one wire.Receiver checks offsets, length and checksum. The model is
    held in memory until written: a flatbuffer is under 2 GiB, and checking the crc32c of a file
    written as it streams in meant reading it all back anyway.
    """

    def __init__(self) -> None:
        self._receiver = wire.Receiver()
        self._info: pb.OdmlModelInfo | None = None
        self._model: np.ndarray | None = None

    def feed(self, response: pb.ExportOdmlResponse) -> None:
        if response.HasField("info"):
            if self._info is not None:
                raise wire.WireError("the server announced the model twice", "DATA_LOSS")
            self._info = response.info
            length = self._info.byte_length
            self._receiver.announce(
                pb.TensorHeader(
                    path="model.tflite",
                    dtype=pb.DTYPE_UINT8,
                    shape=[length],
                    byte_length=length,
                    crc32c=self._info.crc32c,
                )
            )
        else:
            self._receiver.add(response.chunk)
        for _, model in self._receiver.take():  # one tensor: the whole model, checked
            self._model = model

    def check_finished(self) -> None:
        """Raises DATA_LOSS if the stream ended before the announced bytes arrived."""
        if self._info is None or self._model is None:
            raise wire.WireError("the ExportOdml stream ended before the whole model", "DATA_LOSS")

    def write(self, output: str | os.PathLike[str]) -> ExportResult:
        """Writes the model to ``output`` atomically (a ``.partial`` file renamed once whole)."""
        assert self._info is not None and self._model is not None, "check_finished first"
        out = pathlib.Path(output)
        partial = out.with_name(out.name + ".partial")
        try:
            partial.write_bytes(memoryview(self._model))
            os.replace(partial, out)
        finally:
            partial.unlink(missing_ok=True)
        return ExportResult(path=out, info=self._info)


# ---------------------------------------------------------------------------------------- CLI


def add_command(sub: Any) -> None:
    """Adds `qmill export-odml` to the CLI's subparsers."""
    e = sub.add_parser("export-odml", help="export a LiteRT (.tflite) model from a server")
    e.add_argument("--server", required=True, help="HOST:PORT")
    programs.add_model_arguments(e, "model name in the server's registry")
    e.add_argument(
        "--config",
        "--model-config",
        dest="model_config",
        default="",
        help="the model's config as a JSON object (as for `qmill calibrate`)",
    )
    programs.add_params_arguments(e)
    e.add_argument(
        "--calibration-id", default="", help="for static-range rules (w8a8): `qmill calibrate`"
    )
    e.add_argument(
        "--stats",
        help="--model-fn with w8a8: the statistics `qmill calibrate --stats-output` wrote",
    )
    e.add_argument("--rules", default="int8", choices=sorted(PRESETS), help="default int8")
    e.add_argument("--input-shape", default="1,8,8,1", help="one model input, batch first")
    e.add_argument("-o", "--output", required=True, help="the .tflite file to write")
    e.add_argument("--timeout", type=float, help="seconds before a call is abandoned")
    credentials.add_arguments(e)


def run_command(
    client: ServiceClient, args: argparse.Namespace, print_line: Callable[[str], None]
) -> int:
    """Runs `qmill export-odml` on `client`; returns the exit code."""
    if not args.model:
        data = programs.export_program(args, PRESETS[args.rules])
        request = pb.ExportOdmlRequest(**programs.program_fields(client, data))
        return _write(client.export_odml(request, args.output), print_line)
    if not (args.params or args.params_upload_id):
        raise ValueError("--model needs the model's params: --params or --params-upload-id")
    try:
        shape = [int(d) for d in args.input_shape.split(",") if d.strip()]
    except ValueError:
        raise ValueError(
            f"--input-shape {args.input_shape!r}: give integers, batch first, e.g. 1,8,8,1"
        ) from None
    request = pb.ExportOdmlRequest(
        model=pb.ModelSpec(name=args.model, config_json=args.model_config),
        params_upload_id=uploads.params_upload_id(client, args, print_line),
        rules=PRESETS[args.rules],
        calibration_id=args.calibration_id,
        input_shape=shape,
        input_dtype=pb.DTYPE_F32,
    )
    return _write(client.export_odml(request, args.output), print_line)


def _write(result: ExportResult, print_line: Callable[[str], None]) -> int:
    weights = ", ".join(f"{k} {v}" for k, v in sorted(result.info.quantized_weights.items()))
    print_line(f"wrote {result.path} ({result.info.byte_length:,} bytes; weights: {weights})")
    print_line("ops: " + " ".join(result.info.ops))
    return 0
