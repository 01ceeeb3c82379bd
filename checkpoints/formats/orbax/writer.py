"""Writing Orbax PyTree checkpoints incrementally, with memory bounded by a group of leaves.

Orbax has no public "append one leaf" call: `PyTreeCheckpointer.save` wants the whole tree in
memory, and the experimental `ocp.v1.partial.save` merges metadata in quadratic time (minutes
for a few thousand leaves) and nests the tree under `state/`. So the writer drives Orbax's own
`PyTreeCheckpointHandler` directly, which is what `PyTreeCheckpointer.save` does underneath:

1. Leaves are buffered until GROUP_BYTES is reached, then the group is saved with
   `handler.save(staging_dir, PyTreeSave(group))`. Every save adds the group's arrays to the same
   per-process OCDBT store (`ocdbt.process_0/`) and rewrites `_METADATA` with the group's tree;
   the writer keeps the union of the groups' `tree_metadata` entries (one per leaf).
2. On commit the union is written as `_METADATA`, `handler.finalize` merges the OCDBT store into
   the checkpoint's root manifest (as after any Orbax save), `_CHECKPOINT_METADATA` records the
   logical dtypes of carried arrays and the logical shapes of packed 4-bit ones, and the
   staging directory is renamed to the destination.

The result is a plain PyTree checkpoint: `ocp.PyTreeCheckpointer().restore(path)` gives the
nested tree. Peak memory is about two groups (the writer's copies and Orbax's own copy while it
saves) plus the tensor being written, independent of the checkpoint's size; memory_test.py
measures it.

This leans on two behaviours of orbax-checkpoint 0.12 (the ones `ocp.v1.partial` leans on too):
a handler save into an existing directory adds to its OCDBT store, and `_METADATA` keeps one
`tree_metadata` entry per leaf. orbax_test.py pins both through plain restores.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

from qmill.checkpoints.base import dtypes, staging, writer_base
from qmill.checkpoints.formats.orbax import layout as orbax_layout

# Bytes buffered before a group is saved. Each save costs ~25 ms of fixed overhead, so groups
# much smaller than this slow writing down; larger ones only raise peak memory.
GROUP_BYTES = 128 * 2**20


class OrbaxWriter(writer_base.WriterBase):
    def __init__(self, destination: str | os.PathLike, *, overwrite: bool = False) -> None:
        super().__init__()
        self._ocp = orbax_layout.import_orbax()
        self._out = staging.StagedOutput(destination, overwrite=overwrite)
        self._out.staging.mkdir()
        self._started_ns = time.time_ns()
        # Uncompressed: zstd halves write throughput and saves ~8% on float weights, less on
        # quantized ones. Readers decompress per array metadata either way.
        self._handler = self._ocp.PyTreeCheckpointHandler(use_compression=False)
        self._group: dict[tuple[str, ...], np.ndarray] = {}
        self._group_bytes = 0
        self._leaves: set[tuple[str, ...]] = set()
        self._inner: set[tuple[str, ...]] = set()
        self._tree_metadata: dict[str, Any] = {}
        self._last_metadata: dict[str, Any] | None = None
        self._record = dtypes.Record()
        self._empty: dict[str, dict[str, Any]] = {}

    def _put(self, key: str, array: np.ndarray, origin: str) -> None:
        keys = tuple(key.split("/"))
        self._claim(key, keys)
        if array.size == 0:
            # Orbax refuses zero-size arrays ("Cannot save arrays with zero size"): their dtype
            # and shape go into the custom metadata, and our reader recreates them.
            self._empty[key] = {"dtype": array.dtype.name, "shape": list(array.shape)}
            return
        # 4-bit arrays are packed although Orbax holds int4 and float4 natively: tensorstore
        # spends a byte on each.
        stored = self._record.store(key, array, orbax_layout.NATIVE)
        # A copy: the group outlives this call, and callers may reuse their buffers.
        self._group[keys] = np.array(stored, order="C")
        self._group_bytes += stored.nbytes
        if self._group_bytes >= GROUP_BYTES:
            self._save_group()

    def _claim(self, key: str, keys: tuple[str, ...]) -> None:
        """A path is a leaf of a nested dict: it can't also be a node above another leaf."""
        if "" in keys:
            raise ValueError(f"tensor path {key!r} has an empty key between '/'s")
        prefixes = [keys[:i] for i in range(1, len(keys))]
        if keys in self._inner or any(p in self._leaves for p in prefixes):
            raise ValueError(f"tensor {key} and another tensor would share a node of the tree")
        self._leaves.add(keys)
        self._inner.update(prefixes)

    def _save_group(self) -> None:
        if not self._group:
            return
        tree: dict[str, Any] = {}
        for keys, array in self._group.items():
            node = tree
            for k in keys[:-1]:
                node = node.setdefault(k, {})
            node[keys[-1]] = array
        self._handler.save(self._out.staging, args=self._ocp.args.PyTreeSave(tree))
        metadata = json.loads((self._out.staging / orbax_layout.PYTREE_METADATA).read_text())
        self._tree_metadata.update(metadata["tree_metadata"])
        self._last_metadata = metadata
        self._group = {}
        self._group_bytes = 0

    def _commit(self) -> None:
        self._save_group()
        if self._last_metadata is None:
            raise ValueError(
                "nothing to write: an Orbax checkpoint needs at least one non-empty tensor"
            )
        directory = self._out.staging
        metadata = dict(self._last_metadata, tree_metadata=self._tree_metadata)
        (directory / orbax_layout.PYTREE_METADATA).write_text(json.dumps(metadata))
        self._handler.finalize(directory)
        self._handler.close()
        handler_type = type(self._handler)
        step_metadata = {
            "item_handlers": f"{handler_type.__module__}.{handler_type.__qualname__}",
            "metrics": {},
            "performance_metrics": {},
            "init_timestamp_nsecs": self._started_ns,
            "commit_timestamp_nsecs": time.time_ns(),
            "custom_metadata": {
                orbax_layout.QMILL_KEY: {
                    "dtypes": self._record.dtypes,
                    "packed": self._record.packed,
                    "empty": self._empty,
                }
            },
        }
        (directory / orbax_layout.CHECKPOINT_METADATA).write_text(json.dumps(step_metadata))
        self._out.commit()

    def _abort(self) -> None:
        self._group = {}
        self._handler.close()
        self._out.abort()
