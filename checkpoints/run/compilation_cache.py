"""XLA's persistent compilation cache for the in-process engine and the server.

Each run of `qmill quantize` compiles the same few engine programs (one per tensor shape, dtype
and recipe) again: 0.6-0.75 s of a 1 GB folder's ~2.6 s (issue 27). JAX can keep compiled
programs on disk and load them in the next process instead; this module points it at
`$QMILL_COMPILATION_CACHE` (`off` disables it), else `$XDG_CACHE_HOME/qmill/xla`, else
`~/.cache/qmill/xla`. A loaded program is the one a compilation would have made, so outputs are
the same bytes either way (tests/checkpoints/compilation_cache_test.py compares them).

The cache only saves time: a directory that cannot be made or written means a run without it
and one warning line, never a failed run. JAX's own JAX_COMPILATION_CACHE_DIR, where set, wins.
"""

from __future__ import annotations

import logging
import os
import pathlib
import tempfile
import threading

ENV = "QMILL_COMPILATION_CACHE"
OFF = "off"

log = logging.getLogger(__name__)
_lock = threading.Lock()
# Once per process: the first caller decides (None: not yet; else the directory, or "" when
# the cache is off or unusable).
_enabled: str | None = None


def cache_dir(environ: os._Environ[str] | dict[str, str] | None = None) -> pathlib.Path | None:
    """Where the cache lives by the environment; None when it is turned off."""
    environ = os.environ if environ is None else environ
    value = environ.get(ENV, "").strip()
    if value.lower() == OFF:
        return None
    if value:
        return pathlib.Path(value).expanduser()
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "qmill" / "xla"


def enable() -> pathlib.Path | None:
    """Turns the cache on for this process (before its first compilation, to cover them all);
    the directory in use, or None. Only the first call does anything."""
    global _enabled
    with _lock:
        if _enabled is None:
            _enabled = _configure(cache_dir())
        return pathlib.Path(_enabled) if _enabled else None


def _configure(path: pathlib.Path | None) -> str:
    """Points JAX at `path`; the directory JAX uses ("": none)."""
    if path is None:
        return ""
    import jax  # lazy: `import qmill.checkpoints` does not import jax

    if jax.config.jax_compilation_cache_dir is not None:
        # The user's own JAX_COMPILATION_CACHE_DIR (or jax.config) stands, with their settings.
        return str(jax.config.jax_compilation_cache_dir)
    if not _writable(path):
        return ""
    jax.config.update("jax_compilation_cache_dir", str(path))
    # JAX's defaults keep only programs that took 1 s or more to compile; the engine's take
    # 0.1-0.3 s each, and there are a few per run: every one is worth keeping.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return str(path)


def _writable(path: pathlib.Path) -> bool:
    """Whether this process can write in `path` (made if missing); if not, one warning.
    Checked here because JAX would warn on every compilation instead (and pytest's
    warnings-as-errors would turn each warning into a failure)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as e:
        log.warning(
            "qmill: compilation cache off (%s: %s; set %s to a writable directory or off)",
            path,
            e.strerror or e,
            ENV,
        )
        return False
    return True
