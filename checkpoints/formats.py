"""Which format a path holds, and the reader or writer for it."""

from __future__ import annotations

import os
import pathlib
from typing import Any

from qmill.checkpoints import (
    files,
    npz_source,
    npz_writer,
    orbax_layout,
    orbax_source,
    orbax_writer,
    protocols,
    safetensors_header,
    safetensors_source,
    safetensors_writer,
)

FORMATS = ("orbax", "safetensors", "npz")
_ACCEPTED = (
    "an Orbax PyTree checkpoint directory, a .safetensors file, a sharded safetensors set (its "
    "*.safetensors.index.json, or a directory holding one index or *.safetensors files), or an "
    ".npz file"
)
_ZIP_MAGIC = b"PK\x03\x04"


def open_source(path: str | os.PathLike) -> protocols.TensorSource:
    """Opens a checkpoint for reading tensor by tensor.

    Raises:
        FileNotFoundError: nothing at `path`.
        ValueError: `path` holds no checkpoint qmill reads; the message names those it does.
    """
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.is_dir():
        return _open_directory(path)
    files.require_regular_file(path)
    name = path.name
    if name.endswith(".safetensors.index.json"):
        return safetensors_source.open_index(path)
    if name.endswith(".safetensors"):
        return safetensors_source.SafetensorsSource([path])
    if name.endswith(".npz"):
        return npz_source.NpzSource(path)
    # No telling suffix: sniff the first bytes.
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == _ZIP_MAGIC:
        return npz_source.NpzSource(path)
    if safetensors_header.looks_like_safetensors(path):
        return safetensors_source.SafetensorsSource([path])
    raise ValueError(f"{path} is not a checkpoint qmill reads; expected {_ACCEPTED}")


def format_for_destination(destination: str | os.PathLike, source_format: str) -> str:
    """The format an output is written in when none is asked for: the one its name's suffix
    says (`out.npz`, `out.safetensors`), else the source's. A user who names a file `x.npz`
    expects an npz, not an Orbax directory called x.npz."""
    name = pathlib.Path(destination).name
    if name.endswith(".safetensors"):
        return "safetensors"
    if name.endswith(".npz"):
        return "npz"
    return source_format


def _open_directory(path: pathlib.Path) -> protocols.TensorSource:
    pytree = orbax_layout.find_pytree_dir(path)
    if pytree is not None:
        return orbax_source.OrbaxSource(pytree)
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if len(indexes) == 1:
        return safetensors_source.open_index(indexes[0])
    if len(indexes) > 1:
        names = ", ".join(p.name for p in indexes)
        raise ValueError(f"{path} holds several safetensors indexes ({names}); name one of them")
    files = sorted(path.glob("*.safetensors"))
    if files:
        return safetensors_source.SafetensorsSource(files)
    raise ValueError(
        f"{path} is a directory without a checkpoint qmill reads; expected {_ACCEPTED}"
    )


def create_writer(
    destination: str | os.PathLike,
    format: str,
    *,
    like: Any = None,
    overwrite: bool = False,
    max_shard_bytes: int | None = None,
) -> protocols.CheckpointWriter:
    """A writer that stages the output beside `destination` and renames it into place on commit.

    Args:
        destination: an Orbax checkpoint directory; an .npz file; for safetensors a file ending
            in .safetensors, or any other path for a directory in the Hugging Face layout
            (model.safetensors, or shards plus model.safetensors.index.json).
        format: "orbax", "safetensors" or "npz".
        like: the source being converted. A sharded safetensors source makes the safetensors
            output sharded the same way; its __metadata__ is carried over.
        overwrite: replace an existing destination (only once the new output is complete).
        max_shard_bytes: safetensors only, when `like` does not shard: start a new shard before
            a tensor that would make the current one larger than this.

    Raises:
        ValueError: unknown format, or options the format does not take.
        FileExistsError: `destination` exists and `overwrite` is False.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown checkpoint format {format!r}; qmill writes {', '.join(FORMATS)}")
    if max_shard_bytes is not None and (format != "safetensors" or max_shard_bytes <= 0):
        raise ValueError("max_shard_bytes is a positive byte count for safetensors output only")
    if format == "safetensors":
        return safetensors_writer.SafetensorsWriter(
            destination, like=like, overwrite=overwrite, max_shard_bytes=max_shard_bytes
        )
    if format == "npz":
        return npz_writer.NpzWriter(destination, overwrite=overwrite)
    return orbax_writer.OrbaxWriter(destination, overwrite=overwrite)
