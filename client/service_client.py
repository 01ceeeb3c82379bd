"""What the per-service command helpers need of a connected client, as a protocol.

client.Client is built from the per-service modules (uploads, jobs, calibrate, export_odml), and
their command functions take that Client back as an argument. Typing them against this protocol
keeps those modules below client.py: nothing here imports client.py, so no import ring.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import numpy as np

from qmill.proto.v1 import qmill_pb2 as pb


class ServiceClient(Protocol):
    """The calls of client.Client that the command helpers make."""

    @property
    def jobs(self) -> Any: ...

    def upload(
        self,
        source: Any,
        *,
        name: str = "",
        upload_id: str = "",
        chunk_bytes: int = ...,
        retries: int = 5,
        on_sent: Callable[[int], None] | None = None,
    ) -> pb.UploadStatus: ...

    def quantize_upload(
        self, recipe: Any, upload_id: str, *, static_ranges: pb.StaticRanges | None = None
    ) -> Iterator[Any]: ...

    def calibrate(
        self,
        start: pb.CalibrateStart,
        batches: Iterable[np.ndarray],
        *,
        on_progress: Callable[[pb.CalibrateProgress], None] | None = None,
    ) -> Any: ...

    def export_odml(self, request: pb.ExportOdmlRequest, output: str | os.PathLike[str]) -> Any: ...
