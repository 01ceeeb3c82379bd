"""A small deterministic Flax-MLP-like checkpoint for the quick start, tests and benchmarks."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np

from qmill.checkpoints.formats import registry as formats


def example_tree(seed: int = 0) -> dict[str, np.ndarray]:
    """The example's tensors by '/'-joined path; the same seed gives the same bytes."""
    rng = np.random.default_rng(seed)
    return {
        "params/Conv_0/kernel": rng.normal(0, 0.2, (3, 3, 8, 16)).astype(np.float32),
        "params/Dense_0/bias": rng.normal(0, 0.1, (128,)).astype(np.float32),
        "params/Dense_0/kernel": rng.normal(0, 0.1, (64, 128)).astype(ml_dtypes.bfloat16),
        "params/Dense_1/kernel": rng.normal(0, 0.1, (128, 64)).astype(np.float32),
        "params/Embed_0/embedding": rng.normal(0, 1.0, (100, 64)).astype(np.float32),
        "step": np.array(1000, np.int32),
    }


def write_example_checkpoint(
    dest: str | os.PathLike, format: str = "orbax", *, seed: int = 0, overwrite: bool = False
) -> None:
    """Writes the example tree to `dest` as an Orbax directory, a safetensors file (or directory
    when `dest` does not end in .safetensors) or an .npz file."""
    with formats.create_writer(dest, format, overwrite=overwrite) as writer:
        for path, array in example_tree(seed).items():
            writer.write(path, array)
