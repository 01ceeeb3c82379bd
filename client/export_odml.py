"""Client side of ExportOdml: ask a server for a LiteRT model, check it, write it atomically."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Sequence

import grpc

from qmill.client import errors
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
        raise errors.QmillError.from_rpc_error(e) from None
    finally:
        partial.unlink(missing_ok=True)
    return ExportResult(path=out, info=info)
