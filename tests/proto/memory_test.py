"""proto/memory.py: the allocator settings are accepted where they apply (glibc)."""

import os
import platform
import subprocess
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


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="mallopt's parameters are glibc's",
)
@pytest.mark.parametrize("environment, applied", [(None, "True"), ("4", "False")])
def test_arenas_are_capped_unless_the_environment_sets_them(environment, applied):
    # In a process of its own: the cap would stay with this one's threads.
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    if environment is not None:
        env["MALLOC_ARENA_MAX"] = environment  # the operator's choice, applied by glibc
    code = "from qmill.proto import memory; print(memory.limit_arenas())"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == applied
