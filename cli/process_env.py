"""The process settings an in-process calibrated language-model run wants, decided before jax
makes its backend and before the C library's malloc reads its tunables.

Both are measured in bench/README.md (issue 34):
- XLA:GPU's autotuning cost 80 of a cold first layer's 91 s on an H200 and bought nothing per
  layer (0.72 s a layer without it, 0.79 s with): off. XLA reads XLA_FLAGS when jax makes its
  backend, so setting it in this process is enough.
- glibc: the calibration unmaps blocks of 4 MiB and more when they are freed (checkpoints/lm/
  calibration.py), which keeps its peak RSS ~300 MB lower but makes every fresh stage temporary
  fault in 4 KiB pages. With `glibc.malloc.hugetlb=1` those mappings are advised onto
  transparent huge pages: the faults' cost goes and the memory stays (4 layers, one core: 73.8 s
  -> 61.2 s at 905 MB; without the unmapping 60.8 s at 1,226 MB). glibc reads its tunables when
  the process starts, so the command re-executes itself once with it set (Linux + glibc only;
  a glibc without the tunable ignores it, a kernel with THP off gives 4 KiB pages as before).
A user's own setting of either flag wins.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping, Sequence

_AUTOTUNE = "xla_gpu_autotune_level"
_HUGETLB = "glibc.malloc.hugetlb"


def calibrated_run_env(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` with the calibrated run's settings added where the user set none."""
    env = dict(environ)
    flags = env.get("XLA_FLAGS", "")
    if _AUTOTUNE not in flags:
        env["XLA_FLAGS"] = f"{flags} --{_AUTOTUNE}=0".strip()
    tunables = env.get("GLIBC_TUNABLES", "")
    if _HUGETLB not in tunables:
        env["GLIBC_TUNABLES"] = ":".join(t for t in (tunables, f"{_HUGETLB}=1") if t)
    return env


def prepare_calibrated_run(argv: Sequence[str], own_process: bool) -> None:
    """Sets the calibrated run's settings; re-executes `qmill argv` with them when glibc must
    see them at start-up and this call is the process's entry point (`own_process`: never from
    a caller that runs main() in its own process, such as a test)."""
    env = calibrated_run_env(os.environ)
    restart = env.get("GLIBC_TUNABLES") != os.environ.get("GLIBC_TUNABLES")
    if restart and own_process and _glibc_linux():
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "qmill.cli", *argv], env)
    os.environ["XLA_FLAGS"] = env["XLA_FLAGS"]


def _glibc_linux() -> bool:
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
