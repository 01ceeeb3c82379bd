"""A running job's progress: the pipeline's counters, written to the job store (and so to
watchers, on every replica), and the job's partial output copied for other replicas (mirror.py).
"""

from __future__ import annotations

from collections.abc import Callable

from qmill.server.jobs import mirror as mirror_lib


class JobProgress:
    """pipeline.Progress of one job; `update(**fields)` writes the job's fields."""

    def __init__(
        self, update: Callable[..., object], mirror: mirror_lib.PartialMirror | None
    ) -> None:
        self._update, self._mirror = update, mirror
        self._tensors = self._bytes = 0
        self._total = 0

    def start(self, total_bytes: int, total_tensors: int) -> None:
        self._total = total_tensors
        self._update(
            tensors_total=total_tensors, bytes_total=total_bytes, tensors_done=0, bytes_done=0
        )

    def advance(self, nbytes: int) -> None:
        """After a tensor is finished (and recorded in the partial output)."""
        self._tensors += 1
        self._bytes += nbytes
        if self._mirror is not None:
            self._mirror.sync()
        self._update(
            tensors_done=self._tensors,
            bytes_done=self._bytes,
            message=f"tensor {self._tensors}/{self._total} done",
        )
