"""`qmill export-odml`: a LiteRT model from a server (the client's ExportOdml,
client/export_odml.py), params from a checkpoint (uploaded, once) or an upload id.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from qmill.cli import programs, uploads
from qmill.client import credentials
from qmill.client import programs as client_programs
from qmill.client.export_odml import ExportResult
from qmill.client.service_client import ServiceClient
from qmill.proto.v1 import qmill_pb2 as pb

# Named rule sets for the CLI: weight-only int8 / int4, and static-range int8 (needs a calibration).
PRESETS: dict[str, list[pb.ModelRule]] = {
    "int8": [pb.ModelRule(weight_qtype="int8")],
    "int4": [pb.ModelRule(weight_qtype="int4")],
    "w8a8": [pb.ModelRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)],
}


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
        request = pb.ExportOdmlRequest(**client_programs.program_fields(client, data))
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
