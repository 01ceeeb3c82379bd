"""Client side of ExportOdml: ask a server for a LiteRT model, check it, write it atomically.

Also the `qmill export-odml` command: params from a checkpoint (uploaded, once) or an upload id.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from qmill.client import credentials, errors, uploads
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc

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


def export_odml(
    channel: grpc.Channel,
    request: pb.ExportOdmlRequest,
    output: str | os.PathLike[str],
    *,
    metadata: Sequence[tuple[str, str]] | None = None,
    timeout: float | None = None,
) -> ExportResult:
    """Streams the .tflite of ``request`` into ``output`` (written under its name only if whole).

    Raises:
      errors.QmillError: the call failed, or the bytes do not match the announced length / crc32c.
    """
    out = pathlib.Path(output)
    partial = out.with_name(out.name + ".partial")
    stub = pb_grpc.OdmlExporterStub(channel)
    info: pb.OdmlModelInfo | None = None
    received = 0
    try:
        with partial.open("wb") as f:
            for response in stub.ExportOdml(request, metadata=metadata, timeout=timeout):
                if response.HasField("info"):
                    info = response.info
                    continue
                chunk = response.chunk
                if info is None or chunk.offset != received:
                    raise errors.QmillError("DATA_LOSS", f"unexpected chunk at offset {received}")
                f.write(chunk.data)
                received += len(chunk.data)
        if info is None or received != info.byte_length:
            raise errors.QmillError(
                "DATA_LOSS",
                f"got {received} bytes, the server announced "
                f"{None if info is None else info.byte_length}",
            )
        if wire.crc32c(partial.read_bytes()) != info.crc32c:
            raise errors.QmillError("DATA_LOSS", "the .tflite bytes fail their crc32c check")
        os.replace(partial, out)
    except grpc.RpcError as e:
        raise errors.from_rpc_error(e) from None
    finally:
        partial.unlink(missing_ok=True)
    return ExportResult(path=out, info=info)


# ---------------------------------------------------------------------------------------- CLI


def add_command(sub: Any) -> None:
    """Adds `qmill export-odml` to the CLI's subparsers."""
    e = sub.add_parser("export-odml", help="export a LiteRT (.tflite) model from a server")
    e.add_argument("--server", required=True, help="HOST:PORT")
    e.add_argument("--model", required=True, help="model name in the server's registry")
    e.add_argument(
        "--config",
        "--model-config",
        dest="model_config",
        default="",
        help="the model's config as a JSON object (as for `qmill calibrate`)",
    )
    uploads.add_params_arguments(e)
    e.add_argument(
        "--calibration-id", default="", help="for static-range rules (w8a8): `qmill calibrate`"
    )
    e.add_argument("--rules", default="int8", choices=sorted(PRESETS), help="default int8")
    e.add_argument("--input-shape", default="1,8,8,1", help="one model input, batch first")
    e.add_argument("-o", "--output", required=True, help="the .tflite file to write")
    e.add_argument("--timeout", type=float, help="seconds before a call is abandoned")
    credentials.add_arguments(e)


def run_command(args: argparse.Namespace, print_line: Callable[[str], None]) -> int:
    """Runs `qmill export-odml`; returns the exit code."""
    try:
        shape = [int(d) for d in args.input_shape.split(",") if d.strip()]
    except ValueError:
        raise ValueError(
            f"--input-shape {args.input_shape!r}: give integers, batch first, e.g. 1,8,8,1"
        ) from None
    creds = credentials.from_args(args)
    with contextlib.closing(uploads.open_channel(args.server, creds)) as channel:
        request = pb.ExportOdmlRequest(
            model=pb.ModelSpec(name=args.model, config_json=args.model_config),
            params_upload_id=uploads.params_upload_id(channel, args, print_line),
            rules=PRESETS[args.rules],
            calibration_id=args.calibration_id,
            input_shape=shape,
            input_dtype=pb.DTYPE_F32,
        )
        result = export_odml(channel, request, args.output, timeout=args.timeout)
    weights = ", ".join(f"{k} {v}" for k, v in sorted(result.info.quantized_weights.items()))
    print_line(f"wrote {result.path} ({result.info.byte_length:,} bytes; weights: {weights})")
    print_line("ops: " + " ".join(result.info.ops))
    return 0
