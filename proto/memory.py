"""Keeping freed tensor-sized blocks in the process for the next tensor (glibc malloc).

With glibc's defaults, blocks of several MB are mapped on allocation and unmapped when freed (or
trimmed off the heap's top), so every tensor's buffers fault their pages in again and the kernel
zeroes them. keep_freed_buffers() serves blocks up to 32 MiB from the heap and keeps them;
give_back_free_memory() returns the free pages.

The server no longer calls keep_freed_buffers (issue 17): wire's assembly-buffer reuse removed
most of that cost, for tensors of any size, and what the tuning still saved (~0.05 s of server
CPU per 0.5 GB, 2-core dev VM) cost 65-90 MB of server peak RSS (bench/README.md). It is kept for
measuring (bench/rss_bench.py patches it) and for embedders that want the trade. A server stream
does call give_back_free_memory when it ends, and `qmill serve` caps malloc's arenas at start
(limit_arenas).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
# The largest mmap threshold glibc accepts (HEAP_MAX_SIZE / 2 on 64-bit): blocks up to 32 MiB
# come from the heap; larger ones are still mapped on their own.
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_BYTES = 256 * 1024 * 1024
TOP_PAD_BYTES = 64 * 1024 * 1024


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        libc.malloc_trim.argtypes = (ctypes.c_size_t,)
    except (OSError, AttributeError):  # musl and others: keep their defaults
        return None
    return libc


def give_back_free_memory() -> bool:
    """Returns the heap's free pages to the system (malloc_trim); True if any were returned.

    For the end of a stream: kept blocks are worth their pages while tensors keep coming, not
    while the server waits for its next call (its RSS would stay at the busiest call's peak).
    """
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


@functools.cache
def keep_freed_buffers() -> bool:
    """Tunes this process's malloc once (glibc only); returns whether it was applied."""
    libc = _libc()
    if libc is None:
        return False
    return all(
        libc.mallopt(param, value)
        for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            (_M_TRIM_THRESHOLD, TRIM_BYTES),
            (_M_TOP_PAD, TOP_PAD_BYTES),
        )
    )


# malloc arenas of a server (limit_arenas). Each thread that allocates gets an arena of its own up
# to 8 per core; blocks freed in one arena serve only the threads of that arena, and each keeps
# free pages of its own. On the 2-core dev VM a server ran 8 arenas holding ~230 MB at its
# peak against ~100 MB in one (bench/README.md, issue 27).
SERVER_ARENAS = 1


def limit_arenas(count: int = SERVER_ARENAS) -> bool:
    """Caps this process's malloc arenas at `count` (glibc only), unless $MALLOC_ARENA_MAX sets
    them; returns whether the cap was applied. Call it before threads start: the arenas that
    exist stay."""
    libc = _libc()
    if libc is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(libc.mallopt(_M_ARENA_MAX, count))
