"""Digests of a checkpoint for the byte-for-byte tests (output_digest_test, cli_digest_test)."""

from __future__ import annotations

import hashlib
import pathlib

from qmill.checkpoints.formats import registry as formats


def tensors(path: pathlib.Path) -> str:
    """Every tensor's path, dtype, shape and bytes as a reader gets them back: for Orbax, whose
    data files are named at random and whose metadata stamps times."""
    digest = hashlib.sha256()
    with formats.open_source(path) as source:
        for entry in source.entries():
            array = source.read(entry.path)
            digest.update(f"{entry.path}\0{array.dtype.name}\0{array.shape}\0".encode())
            digest.update(array.tobytes())
    return digest.hexdigest()


def files(path: pathlib.Path) -> str:
    """A file's bytes, or a folder's files' names and bytes."""
    digest = hashlib.sha256()
    found = [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file())
    for f in found:
        digest.update(f.relative_to(path).as_posix().encode() if path.is_dir() else b"")
        digest.update(f.read_bytes())
    return digest.hexdigest()


def output(path: pathlib.Path) -> str:
    """An output's digest: its tensors for an Orbax directory, its files otherwise."""
    return tensors(path) if (path / "_METADATA").exists() else files(path)
