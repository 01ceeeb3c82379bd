"""Orbax PyTree checkpoints, one leaf at a time. Orbax (and so jax) is imported on first use.

Reading lists leaves from the checkpoint's metadata and restores one leaf per `read` with a
partial restore. Writing stages each leaf as a memory-mapped .npy file on disk and hands Orbax a
tree of read-only memmaps on commit: the data flows from disk to the checkpoint without the whole
tree ever being resident in memory. Leaves are nested dicts keyed by the '/'-split path.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Any

import numpy as np

from qmill.client.checkpoints import base

DTYPES_FILE = "qmill_dtypes.json"
# uint4 and float8_e4m3 are refused by Orbax's tensorstore backend; they use carriers.
_UNSUPPORTED = frozenset({"uint4", "float8_e4m3"})


def _ocp():
    import logging

    import orbax.checkpoint as ocp

    # Orbax logs every save and restore at INFO/WARNING; one leaf at a time makes that noise.
    logging.getLogger("absl").setLevel(logging.ERROR)
    return ocp


def is_orbax_dir(path: pathlib.Path) -> bool:
    return path.is_dir() and any((path / n).exists() for n in ("_METADATA", "_CHECKPOINT_METADATA"))


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"{path}: a parent path is also a tensor")
        if leaf in node:
            raise ValueError(f"tensor {path} written twice")
        node[leaf] = value
    return tree


class OrbaxSource:
    format = "orbax"
    separator = "/"

    def __init__(self, path: pathlib.Path) -> None:
        import jax

        ocp = _ocp()
        self.path = path.absolute()  # Orbax finds no metadata under a relative path
        self._checkpointer = ocp.PyTreeCheckpointer()
        metadata = self._checkpointer.metadata(self.path)
        item = getattr(metadata, "item_metadata", metadata)
        if item is None:
            raise ValueError(
                f"{path}: Orbax checkpoint without tree metadata; re-save it with "
                "orbax-checkpoint >= 0.5"
            )
        tree = getattr(item, "tree", item)
        side = path / DTYPES_FILE
        self._logical: dict[str, str] = json.loads(side.read_text()) if side.exists() else {}
        self._entries = []
        for key_path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            name = "/".join(_key_name(k) for k in key_path)
            dtype = np.dtype(leaf.dtype)
            if name in self._logical:
                dtype = base.from_carrier(np.zeros(0, leaf.dtype), self._logical[name]).dtype
            self._entries.append(base.TensorEntry(name, dtype, tuple(leaf.shape)))
        self._entries.sort(key=lambda e: e.path)

    def entries(self) -> list[base.TensorEntry]:
        return list(self._entries)

    def read(self, path: str) -> np.ndarray:
        ocp = _ocp()
        item = _nest({path: 0})
        restore_args = _nest({path: ocp.RestoreArgs(restore_type=np.ndarray)})
        restored = self._checkpointer.restore(
            self.path,
            args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True),
        )
        for part in path.split("/"):
            restored = restored[part]
        return base.from_carrier(np.asarray(restored), self._logical.get(path))

    def close(self) -> None:
        return None

    def __enter__(self) -> OrbaxSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class OrbaxWriter(base.WriterBase):
    def __init__(
        self, destination: str | os.PathLike, *, overwrite: bool = False, **_: Any
    ) -> None:
        self._out = base.AtomicOutput(destination, overwrite=overwrite)
        self._stage = self._out.staging.with_name(self._out.staging.name + "-leaves")
        self._stage.mkdir()
        # path -> (staged .npy file, dtype to view it as: npy cannot name bfloat16 or float8)
        self._files: dict[str, tuple[pathlib.Path, np.dtype]] = {}
        self._logical: dict[str, str] = {}

    def write(self, path: str, array: np.ndarray) -> None:
        if path in self._files:
            raise ValueError(f"tensor {path} written twice")
        array = np.asarray(array)
        if array.dtype.name in _UNSUPPORTED:
            array, self._logical[path] = base.to_carrier(array, frozenset())
        file = self._stage / f"{len(self._files)}.npy"
        # npy cannot name ml_dtypes types: they are staged as unsigned ints of their width.
        raw = (
            array
            if array.dtype.type.__module__ == "numpy"
            else array.view(f"u{array.dtype.itemsize}")
        )
        np.save(file, raw, allow_pickle=False)
        self._files[path] = (file, array.dtype)

    def write_quantized(self, path: str, parts: dict[str, np.ndarray]) -> None:
        for key, value in base.quantized_paths(path, parts, "/").items():
            self.write(key, value)

    def commit(self) -> None:
        leaves = {
            p: np.load(f, mmap_mode="r", allow_pickle=False).view(dtype)
            for p, (f, dtype) in self._files.items()
        }
        # Orbax wants real scalars for 0-d leaves; they are tiny.
        leaves = {p: (np.asarray(a).copy() if a.ndim == 0 else a) for p, a in leaves.items()}
        _ocp().PyTreeCheckpointer().save(self._out.staging, _nest(leaves))
        if self._logical:
            (self._out.staging / DTYPES_FILE).write_text(json.dumps(self._logical, sort_keys=True))
        del leaves
        shutil.rmtree(self._stage, ignore_errors=True)
        self._out.commit()

    def abort(self) -> None:
        shutil.rmtree(self._stage, ignore_errors=True)
        self._out.abort()
