"""The persistent compilation cache: where it lives, that a warm cache is used, that its outputs
are the very bytes a run without it writes, and that an unusable directory never fails a run.

Each run is a fresh `qmill quantize` process (the cache is per process state in JAX), with
$QMILL_COMPILATION_CACHE pointing into tmp_path, never at the user's cache.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from qmill.checkpoints.run import compilation_cache

HIT = "Persistent compilation cache hit"


def test_the_default_is_the_user_cache_dir(tmp_path) -> None:
    xdg = {"XDG_CACHE_HOME": str(tmp_path)}
    assert compilation_cache.cache_dir(xdg) == tmp_path / "qmill" / "xla"
    default = pathlib.Path(os.path.expanduser("~")) / ".cache" / "qmill" / "xla"
    assert compilation_cache.cache_dir({}) == default


def test_the_variable_moves_or_disables_it(tmp_path) -> None:
    env = {"XDG_CACHE_HOME": "/elsewhere"}
    assert compilation_cache.cache_dir({**env, "QMILL_COMPILATION_CACHE": str(tmp_path)}) == (
        tmp_path
    )
    for off in ("off", "OFF", " off "):
        assert compilation_cache.cache_dir({**env, "QMILL_COMPILATION_CACHE": off}) is None
    # Set but empty: the default, as when unset.
    assert compilation_cache.cache_dir({**env, "QMILL_COMPILATION_CACHE": ""}) == pathlib.Path(
        "/elsewhere/qmill/xla"
    )


def _source(path: pathlib.Path) -> pathlib.Path:
    """Three shapes and two float dtypes: three programs to compile (and a kept 1-D bias)."""
    rng = np.random.default_rng(0)
    tensors = {
        "a.weight": rng.normal(size=(64, 256)).astype(ml_dtypes.bfloat16),
        "b.weight": rng.normal(size=(128, 128)).astype(np.float32),
        "c.weight": rng.normal(size=(256, 64)).astype(ml_dtypes.bfloat16),
        "c.bias": rng.normal(size=(64,)).astype(np.float32),
    }
    safetensors.numpy.save_file(tensors, str(path))
    return path


def _quantize(source: pathlib.Path, out: pathlib.Path, cache: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "QMILL_COMPILATION_CACHE": cache, "JAX_LOG_COMPILES": "1"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    args = ["quantize", str(source), "-o", str(out), "--recipe", "int4", "-q"]
    done = subprocess.run(
        [sys.executable, "-m", "qmill.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.slow  # three `qmill` processes
def test_cold_and_warm_cache_write_the_same_bytes_as_no_cache(tmp_path) -> None:
    source = _source(tmp_path / "model.safetensors")
    cache = tmp_path / "xla"
    cold = _quantize(source, tmp_path / "cold.safetensors", str(cache))
    entries = sorted(p.name for p in cache.iterdir())
    assert len([e for e in entries if e.startswith("jit__quantize_and_measure")]) == 3
    assert HIT not in cold.stderr
    warm = _quantize(source, tmp_path / "warm.safetensors", str(cache))
    # Every program came from the cache (one hit each), and none was written anew.
    assert warm.stderr.count(HIT) >= 3, warm.stderr
    assert sorted(p.name for p in cache.iterdir()) == entries
    off = _quantize(source, tmp_path / "off.safetensors", "off")
    assert HIT not in off.stderr
    expected = (tmp_path / "off.safetensors").read_bytes()
    assert (tmp_path / "cold.safetensors").read_bytes() == expected
    assert (tmp_path / "warm.safetensors").read_bytes() == expected


@pytest.mark.slow  # one `qmill` process
def test_an_unusable_directory_means_a_run_without_it_and_one_line(tmp_path) -> None:
    source = _source(tmp_path / "model.safetensors")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    done = _quantize(source, tmp_path / "out.safetensors", str(blocker / "xla"))
    lines = [line for line in done.stderr.splitlines() if "compilation cache off" in line]
    assert len(lines) == 1, done.stderr
    assert str(blocker / "xla") in lines[0]
    assert HIT not in done.stderr
    assert (tmp_path / "out.safetensors").stat().st_size > 0


def test_jax_own_cache_dir_wins_and_ours_is_not_made(tmp_path) -> None:
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax")}
    env["QMILL_COMPILATION_CACHE"] = str(tmp_path / "ours")
    code = "from qmill.checkpoints.run import compilation_cache as c; print(c.enable())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "jax")
    assert not (tmp_path / "ours").exists()


def test_off_turns_it_off_in_the_process(tmp_path) -> None:
    env = {**os.environ, "QMILL_COMPILATION_CACHE": "off"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    code = (
        "import jax; from qmill.checkpoints.run import compilation_cache as c; "
        "print(c.enable(), jax.config.jax_compilation_cache_dir)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "None"]
