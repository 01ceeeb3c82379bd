"""Keeping freed tensor buffers in the process for the next tensor (glibc malloc).

A server assembles each tensor into a fresh buffer, and protobuf copies every 4 MiB chunk into new
bytes objects. With glibc's defaults, blocks that large are mapped on allocation and unmapped when
freed (or trimmed off the heap's top), so every tensor faults its pages in again and the kernel
zeroes them: ~0.25 s of system time per 0.5 GB received on the 2-core dev VM (bench/README.md,
issue 17). Served from the heap and kept there, the same pages are reused, tensor after tensor.

Memory is still bounded by what the process holds at once (a few tensors): kept blocks are reused
before new ones are taken, and at most TRIM_BYTES of free heap top is kept beyond that.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc accepts (HEAP_MAX_SIZE / 2 on 64-bit): blocks up to 32 MiB
# come from the heap; larger ones are still mapped on their own.
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
TRIM_BYTES = 256 * 1024 * 1024
TOP_PAD_BYTES = 64 * 1024 * 1024


@functools.cache
def keep_freed_buffers() -> bool:
    """Tunes this process's malloc once (glibc only); returns whether it was applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: keep their defaults
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return all(
        mallopt(param, value)
        for param, value in (
            (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            (_M_TRIM_THRESHOLD, TRIM_BYTES),
            (_M_TOP_PAD, TOP_PAD_BYTES),
        )
    )
