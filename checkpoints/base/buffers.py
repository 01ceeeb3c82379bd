"""Read buffers reused once nothing refers to them any more.

A source hands out one tensor at a time, tens of MB each, and the caller keeps a few in flight
(the client's byte window). A fresh buffer per tensor costs a page fault per 4 kB as it is filled,
plus the kernel zeroing it: glibc maps buffers over 32 MiB fresh every time and trims the heap
under smaller ones once a few are freed. On the 2-core dev VM that was ~20 % of the client's
samples. A kept buffer is reused only when the pool's list is its last holder (sys.getrefcount):
the tensor handed out, its views, a memoryview or an engine array made from it all hold a
reference to it, so a buffer still being sent or quantized is never overwritten.

The same rule as the server's assembly buffers (proto/wire.py's _Buffers); kept apart because
checkpoints/ may not import proto.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

# Alignment of the buffers handed out: XLA:CPU uses a 64-byte aligned buffer in place.
ALIGNMENT = 64


class BufferPool:
    """Uninitialized uint8 buffers, kept for reuse up to `keep_bytes` in all.

    `keep_bytes` should cover what the caller holds at once (the client's window of 256 MiB plus
    the tensor being read): a buffer dropped from the pool while in use is not reused later.
    Buffers under `min_bytes` are not kept: malloc serves those from its heap cheaply.
    """

    def __init__(self, keep_bytes: int = 512 << 20, min_bytes: int = 1 << 20) -> None:
        self._keep_bytes = keep_bytes
        self._min_bytes = min_bytes
        self._kept: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A 64-byte aligned uint8 array of `nbytes`, its contents undefined."""
        need = nbytes + ALIGNMENT
        if need < self._min_bytes:
            raw = np.empty(need, np.uint8)
        else:
            with self._lock:
                raw = self._reusable(need)
                if raw is None:
                    raw = np.empty(need, np.uint8)
                    self._kept.append(raw)
                    self._trim()
        start = -raw.ctypes.data % ALIGNMENT
        return raw[start : start + nbytes]

    def _reusable(self, need: int) -> np.ndarray | None:
        # By index, not enumerate(): its reused result tuple would hold one more reference.
        for i in range(len(self._kept)):
            raw = self._kept[i]
            # 3 references: the list, `raw` and getrefcount's argument; any more is a user.
            # At most twice the size asked for, so a large buffer is not tied up by small tensors.
            if need <= raw.size <= 2 * need and sys.getrefcount(raw) == 3:
                # Most recently used last: _trim drops the least recently used first.
                self._kept.append(self._kept.pop(i))
                return raw
        return None

    def _trim(self) -> None:
        # The newest (just taken) always stays, whatever its size.
        while len(self._kept) > 1 and sum(r.size for r in self._kept) > self._keep_bytes:
            del self._kept[0]  # in use or not: no longer kept (a user's reference keeps it alive)

    def release(self) -> None:
        """Drops every kept buffer (those still in use live on until their users are done)."""
        with self._lock:
            self._kept.clear()
