"""Client side of ExportOdml: ask a server for a LiteRT model, check it, write it atomically.

The `qmill export-odml` command is qmill.cli.export_odml's.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import numpy as np

from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb


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
