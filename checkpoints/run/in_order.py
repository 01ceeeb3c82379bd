"""The checkpoint written in entry order while tensors finish (the pipeline's writing half)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from qmill.checkpoints.base import protocols, staging


class InOrder:
    """Writes the checkpoint in entry order while tensors finish, not after the last one.

    A tensor is written once every entry before it is: in a single stream results come in
    order, so each is written as it arrives, from the parts in memory, while the backend works
    on the next ones. Results that come early (several replicas or streams) wait in the partial
    output until their turn. Kept and never-sent tensors are read from the source here, from
    the caller's thread: only when the source allows reads from several threads (the backend's
    request thread reads it too), else at the end. The order, and so the checkpoint's bytes,
    are those of writing everything at the end.

    `sent(path)` says whether the backend answers for a tensor (the plan's TensorPlan.sent); one
    it does not (copied, or kept by the plan) is the source's own.

    In place (the writer was given staging.InPlace): a result written on arrival is kept for
    resuming by the writer's own data, noted in its log line with every entry written since the
    last line (`take`), instead of as parts written a second time. A resumed run starts after
    the entries those notes name.
    """

    def __init__(
        self,
        source: protocols.TensorSource,
        entries: list[protocols.TensorEntry],
        partial: staging.PartialOutput,
        writer: Any,
        check: Callable[[], None] | None,
        in_place: bool = False,
        sent: Callable[[str], bool] = lambda _: True,
    ) -> None:
        self._source = source
        self._sent = sent
        self._entries = entries
        self._partial = partial
        self._writer = writer
        self.check = check
        self._in_place = in_place
        # A run that does not write in place has no such notes (quantize_checkpoint refuses).
        self._next = len(partial.written)
        written = [note["path"] for note in partial.written]
        if written != [e.path for e in entries[: len(written)]]:
            raise ValueError(
                f"{partial.directory}: the log's entries written in place are not the "
                "checkpoint's first ones; pass --restart to discard the partial output"
            )
        self._notes: list[dict[str, Any]] = []  # entries written in place, not yet in the log
        self._source_reads = getattr(source, "concurrent_reads", False)
        # A write that failed while tensors were still coming (a full disk): raised at the end,
        # once every result is in the partial output, as when the checkpoint was written last.
        self._failed: OSError | None = None

    def check_parts(self, path: str, parts: dict[str, Any]) -> None:
        """Raises the writer's ValueError for parts its format cannot hold (compressed-tensors:
        an AWQ / SmoothQuant scale), before the tensor is recorded in the partial output."""
        check = getattr(self._writer, "check_parts", None)
        if check is not None:
            check(path, parts)

    def take(self, index: int, path: str, parts: dict[str, Any], info: dict[str, Any]) -> None:
        """Keeps the result for entry `index` (`parts`, empty when the source's own tensor is
        kept) for resuming, and writes what its arrival lets through."""
        turn = self._next == index and self._failed is None
        if self._in_place and turn:
            try:
                self._write((path, parts), final=False)
            except OSError as e:
                self._failed = e  # kept as parts below; the rest of the run writes no more
            if self._failed is None and self._next > index:
                self._partial.record_written(path, info, self._notes)
                self._notes = []
                return
        self._partial.record(index, path, parts, info)
        self.advance(fresh=(path, parts))

    def advance(
        self, *, fresh: tuple[str, dict[str, np.ndarray]] | None = None, final: bool = False
    ) -> None:
        """Writes every entry whose turn has come; `fresh`: the (path, parts) just recorded;
        `final`: every tensor is finished, write the rest."""
        if self._failed is not None:
            if final:
                raise self._failed
            return
        try:
            self._write(fresh, final)
        except OSError as e:
            if final:
                raise
            self._failed = e

    def _write(self, fresh: tuple[str, dict[str, np.ndarray]] | None, final: bool) -> None:
        while self._next < len(self._entries):
            entry = self._entries[self._next]
            parts = self._parts(entry.path, fresh)
            if parts is None and self._sent(entry.path) and not final:
                return  # not answered yet
            if parts:
                if self.check is not None:
                    self.check()
                self._writer.write_quantized(entry.path, parts)
                names = {k: np.dtype(v.dtype).name for k, v in parts.items()}
                note = {"call": "quantized", "parts": names}
            elif final or self._source_reads:
                if self.check is not None:
                    self.check()
                array = self._source.read(entry.path)
                self._writer.write(entry.path, array)
                note = {"call": "source", "dtype": array.dtype.name, "shape": list(array.shape)}
            else:
                return
            if self._in_place:
                self._notes.append(
                    {"path": entry.path, **note, "events": self._writer.take_events()}
                )
            self._next += 1

    def _parts(
        self, path: str, fresh: tuple[str, dict[str, np.ndarray]] | None
    ) -> dict[str, Any] | None:
        """The result for `path`: its parts, {} for the source's own tensor, None if none yet."""
        if fresh is not None and fresh[0] == path:
            return fresh[1]
        done = self._partial.completed.get(path)
        if done is None:
            return None
        return self._partial.load(path) if done["parts"] else {}
