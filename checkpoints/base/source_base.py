"""Behaviour every checkpoint source shares: the list of entries and the context manager.

A format fills `_entries` (in its stable order) when it opens, and implements `read` and `close`.
"""

from __future__ import annotations

from typing import Self

from qmill.checkpoints.base import protocols


class SourceBase:
    _entries: list[protocols.TensorEntry]

    def entries(self) -> list[protocols.TensorEntry]:
        return list(self._entries)

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
