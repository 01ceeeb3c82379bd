"""Checkpoint readers and writers: Orbax, safetensors (single or sharded) and npz.

`open_source` reads a checkpoint tensor by tensor; `create_writer` writes one that appears under
its final name only on commit. `import qmill.client.checkpoints` does not import jax or Orbax;
the Orbax format imports them when used.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

from qmill.client.checkpoints import npz_format, orbax_format, safetensors_format
from qmill.client.checkpoints.base import CheckpointWriter as CheckpointWriter
from qmill.client.checkpoints.base import TensorEntry as TensorEntry
from qmill.client.checkpoints.base import TensorSource as TensorSource

FORMATS = ("orbax", "safetensors", "npz")

__all__ = [
    "FORMATS",
    "CheckpointWriter",
    "TensorEntry",
    "TensorSource",
    "create_writer",
    "open_source",
]


def open_source(path: str | os.PathLike) -> TensorSource:
    """Opens an Orbax directory, a .safetensors file, a sharded set (index file or directory) or
    an .npz file. Raises FileNotFoundError or ValueError naming the accepted formats."""
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if orbax_format.is_orbax_dir(path):
        return orbax_format.OrbaxSource(path)
    if path.is_dir():
        indexes = sorted(path.glob("*.safetensors.index.json"))
        if len(indexes) == 1:
            return safetensors_format.open_index(indexes[0])
        files = sorted(path.glob("*.safetensors"))
        if len(files) == 1 and not indexes:
            return safetensors_format.SafetensorsSource(files)
    elif path.name.endswith(".safetensors.index.json"):
        return safetensors_format.open_index(path)
    elif path.suffix == ".safetensors":
        return safetensors_format.SafetensorsSource([path])
    elif path.suffix == ".npz" or _starts_with(path, b"PK"):
        return npz_format.NpzSource(path)
    elif path.is_file():
        return safetensors_format.SafetensorsSource([path])  # raises if it is not one
    raise ValueError(
        f"{path} is not a checkpoint qmill reads: expected an Orbax checkpoint directory, a "
        ".safetensors file, a *.safetensors.index.json (or a directory with one), or an .npz file"
    )


def _starts_with(path: pathlib.Path, magic: bytes) -> bool:
    with open(path, "rb") as f:
        return f.read(len(magic)) == magic


def create_writer(
    destination: str | os.PathLike, format: str, *, like: Any = None, overwrite: bool = False
) -> Any:
    """A writer (context manager: commit on success, abort on error) for `format`.

    safetensors: `destination` ending in .safetensors is one file; otherwise a directory holding
    model.safetensors, or one shard per input shard plus model.safetensors.index.json when `like`
    is a sharded source.
    """
    writers = {
        "orbax": orbax_format.OrbaxWriter,
        "safetensors": safetensors_format.SafetensorsWriter,
        "npz": npz_format.NpzWriter,
    }
    if format not in writers:
        raise ValueError(f"unknown checkpoint format {format!r}; valid: {', '.join(FORMATS)}")
    return writers[format](destination, like=like, overwrite=overwrite)
