"""Reading Orbax PyTree checkpoints one leaf at a time.

Entries come from the checkpoint's metadata (tree structure plus each array's zarr metadata: no
array data is read). `read` restores a single leaf with a partial restore: the restore template
holds only that leaf (lists keep their length with None elsewhere), so Orbax reads nothing else.
Orbax (and jax) are imported when a source is opened, never by `import qmill.client`.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import numpy as np

from qmill.checkpoints.base import dtypes, files, protocols, source_base
from qmill.checkpoints.formats.orbax import layout as orbax_layout

logger = logging.getLogger(__name__)

# One step from a tree node to its child: (dict key or list index, list length or None for dicts).
_Step = tuple[Any, int | None]


class OrbaxSource(source_base.SourceBase):
    """Leaves in sorted tree order (jax's flattening order: dict keys sorted, lists in order)."""

    format = "orbax"
    separator = "/"

    def __init__(self, path: pathlib.Path) -> None:
        import jax

        self._ocp = orbax_layout.import_orbax()
        # Absolute: Orbax finds no metadata under a relative path.
        self.path = path.absolute()
        files.require_regular_tree(self.path)  # before Orbax opens anything inside
        self._checkpointer = self._ocp.PyTreeCheckpointer()
        metadata = self._checkpointer.metadata(self.path)
        tree_metadata = getattr(metadata, "item_metadata", None)
        if tree_metadata is None:
            raise ValueError(f"{path}: an Orbax checkpoint without tree metadata (_METADATA)")
        tree = getattr(tree_metadata, "tree", tree_metadata)
        custom = getattr(metadata, "custom_metadata", None) or {}
        qmill = custom.get(orbax_layout.QMILL_KEY, {})
        try:
            self._record = dtypes.Record(qmill.get("dtypes"), qmill.get("packed"))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: malformed qmill dtype record ({e})") from None
        # Zero-size arrays, which Orbax cannot store: {path: {"dtype", "shape"}}.
        self._empty: dict[str, dict[str, Any]] = qmill.get("empty", {})
        self._steps: dict[str, tuple[_Step, ...]] = {}
        self._entries: list[protocols.TensorEntry] = []
        for key_path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            steps = _steps(tree, key_path)
            name = "/".join(str(key) for key, _ in steps)
            if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
                # Strings and other non-array leaves are not tensors: they are not copied.
                logger.warning("%s: skipping %s, a %s leaf", path, name, type(leaf).__name__)
                continue
            dtype, shape = self._record.logical(name, np.dtype(leaf.dtype), tuple(leaf.shape))
            self._steps[name] = steps
            self._entries.append(protocols.entry(name, dtype, shape))
        if self._empty:
            for name, spec in self._empty.items():
                dtype = dtypes.logical_dtype(spec["dtype"])
                self._entries.append(protocols.entry(name, dtype, tuple(spec["shape"])))
            # Our writer writes dict-only trees, whose sorted order is that of the key tuples.
            self._entries.sort(key=lambda e: tuple(e.path.split("/")))

    def read(self, path: str) -> np.ndarray:
        if path in self._empty:
            spec = self._empty[path]
            return np.zeros(spec["shape"], dtypes.logical_dtype(spec["dtype"]))
        try:
            steps = self._steps[path]
        except KeyError:
            raise KeyError(f"no tensor {path!r} in {self.path}") from None
        ocp = self._ocp
        restored = self._checkpointer.restore(
            self.path,
            args=ocp.args.PyTreeRestore(
                item=_template(steps, 0),
                restore_args=_template(steps, ocp.RestoreArgs(restore_type=np.ndarray)),
                partial_restore=True,
            ),
        )
        for key, _ in steps:
            restored = restored[key]
        try:
            return self._record.restore(path, np.asarray(restored))
        except ValueError as e:
            raise ValueError(f"{self.path}: {e}") from None

    def close(self) -> None:
        self._checkpointer.close()


def _steps(tree: Any, key_path: tuple[Any, ...]) -> tuple[_Step, ...]:
    steps = []
    node = tree
    for key in key_path:
        if hasattr(key, "idx"):  # SequenceKey: a list or tuple in the tree
            steps.append((key.idx, len(node)))
            node = node[key.idx]
        else:  # DictKey (others: their name)
            name = getattr(key, "key", getattr(key, "name", key))
            steps.append((name, None))
            node = node[name]
    return tuple(steps)


def _template(steps: tuple[_Step, ...], leaf: Any) -> Any:
    """The tree holding `leaf` at `steps` and nothing else, for a partial restore."""
    node = leaf
    for key, length in reversed(steps):
        if length is None:
            node = {key: node}
        else:
            items: list[Any] = [None] * length
            items[key] = node
            node = items
    return node
