"""The QuantizeParams conversation without transport: requests out, outcomes in.

Shared by the sync and async clients, and by the embedded backend's outcomes type, so all three
hand the caller the same `TensorOutcome` records.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from qmill.checkpoints import outcome
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb


def tensor_requests(path: str, array: np.ndarray) -> Iterator[pb.QuantizeParamsRequest]:
    """Header and chunk requests for one tensor."""
    data = wire.to_bytes(array)
    yield pb.QuantizeParamsRequest(header=wire.header_for(path, array, data))
    for chunk in wire.chunks(data):
        yield pb.QuantizeParamsRequest(chunk=chunk)


def how_from_proto(how: pb.HowToQuantize) -> dict[str, Any]:
    return {
        "qtype": how.qtype,
        "channelwise_axes": tuple(how.channelwise_axes),
        "tiled_axes": dict(sorted(how.tiled_axes.items())),
        "calibration_method": how.calibration_method,
    }


class ResponseDecoder:
    """Feeds on responses; returns a TensorOutcome each time a tensor is complete.

    `sent` maps paths of tensors sent but not yet answered to their arrays; the decoder removes
    each path when its answer is complete and attaches the array to kept outcomes.
    """

    def __init__(self, sent: dict[str, np.ndarray]) -> None:
        self._sent = sent
        self._result: pb.TensorResult | None = None
        self._parts: dict[str, np.ndarray] = {}
        self._assembler: wire.Assembler | None = None
        self._pending_headers: list[pb.TensorHeader] = []
        self.summary: pb.Summary | None = None

    def feed(self, response: pb.QuantizeParamsResponse) -> outcome.TensorOutcome | None:
        kind = response.WhichOneof("item")
        if kind == "summary":
            self.summary = response.summary
            return None
        if kind == "result":
            if self._result is not None:
                raise wire.WireError(
                    f"result for {response.result.path} before {self._result.path} ended",
                    "DATA_LOSS",
                )
            self._result = response.result
            self._parts = {}
            self._pending_headers = list(response.result.parts)
            return self._next_part()
        if kind == "chunk":
            if self._assembler is None:
                raise wire.WireError("server sent a chunk outside any tensor part", "DATA_LOSS")
            self._assembler.add(response.chunk)
            if self._assembler.complete:
                self._parts[self._assembler.header.path] = self._assembler.finish()
                self._assembler = None
                return self._next_part()
            return None
        raise wire.WireError(f"unexpected response {kind!r}", "DATA_LOSS")

    def _next_part(self) -> outcome.TensorOutcome | None:
        while self._pending_headers:
            self._assembler = wire.Assembler(self._pending_headers.pop(0))
            if not self._assembler.complete:
                return None
            # A zero-byte part has no chunks.
            self._parts[self._assembler.header.path] = self._assembler.finish()
            self._assembler = None
        result, self._result = self._result, None
        assert result is not None
        self._sent.pop(result.path, None)
        if result.kind == pb.RESULT_KIND_QUANTIZED:
            return outcome.TensorOutcome(
                path=result.path,
                quantized=True,
                parts=self._parts,
                reason=result.reason,
                how=how_from_proto(result.how),
                sqnr_db=result.quality.sqnr_db,
                mean_relative_error=result.quality.mean_relative_error,
                input_bytes=result.input_bytes,
            )
        # A float tensor the server made or holds (RESULT_KIND_FLOAT) came as the part "value".
        return outcome.TensorOutcome(
            path=result.path,
            quantized=False,
            parts=self._parts if result.kind == pb.RESULT_KIND_FLOAT else {},
            reason=result.reason,
            input_bytes=result.input_bytes,
        )

    def check_finished(self) -> None:
        """Raises DATA_LOSS if the server's stream ended without a summary or mid-tensor."""
        if self._result is not None or self.summary is None:
            raise wire.WireError("the server's stream ended before the summary", "DATA_LOSS")
