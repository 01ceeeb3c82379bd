"""proto/memory.py: the allocator settings are accepted where they apply (glibc)."""

import platform
import sys

import pytest

from qmill.proto import memory


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="mallopt's parameters are glibc's",
)
def test_glibc_accepts_every_setting():
    # False would mean a value out of glibc's range (e.g. an mmap threshold over 32 MiB),
    # silently leaving the default, which maps and faults in every large buffer again.
    assert memory.keep_freed_buffers() is True
    assert memory.keep_freed_buffers() is True  # once per process, then cached


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="malloc_trim is glibc's",
)
def test_freed_buffers_are_kept_until_given_back():
    memory.keep_freed_buffers()
    block = bytearray(24 * 1024 * 1024)  # under the 32 MiB threshold: from the heap
    del block  # kept by the heap (up to TRIM_BYTES), not unmapped
    assert memory.give_back_free_memory() is True  # so there were free pages to return
