"""Fixtures for the checkpoint I/O tests (--import-mode=importlib: helpers travel as fixtures)."""

from __future__ import annotations

import numpy as np
import pytest

# Destination names per format: a directory for Orbax, files for the others.
DESTINATIONS = {"orbax": "ckpt", "safetensors": "ckpt.safetensors", "npz": "ckpt.npz"}


def _sample(dtype, shape, seed=0) -> np.ndarray:
    """Deterministic values valid for `dtype` (the full range for small integer types)."""
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.name in ("int4", "uint4", "int2", "uint2"):
        bits = int(dtype.name[-1])
        lo = -(2 ** (bits - 1)) if dtype.name.startswith("int") else 0
        return rng.integers(lo, lo + 2**bits, shape).astype(dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -1000), min(info.max, 1000), shape).astype(dtype)
    if dtype.kind == "c":
        return (rng.normal(0, 2, shape) + 1j * rng.normal(0, 2, shape)).astype(dtype)
    return rng.normal(0, 2, shape).astype(np.float32).astype(dtype)


@pytest.fixture
def sample():
    return _sample


@pytest.fixture(params=sorted(DESTINATIONS))
def fmt(request) -> str:
    return request.param


@pytest.fixture
def dest(tmp_path, fmt):
    return tmp_path / DESTINATIONS[fmt]
