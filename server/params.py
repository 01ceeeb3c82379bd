"""Parameter trees and their paths: the server's one flatten / unflatten.

A path joins the keys from the root to a leaf with '/' ("Dense_0/kernel"), as safetensors
uploads name their tensors, calibrations store their statistics and results name their params.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mapping -> {'/'-joined path: leaf}, in insertion order; leaves kept as they are."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, path + "/"))
        else:
            out[path] = value
    return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{'/'-joined path: leaf} -> nested dict. Raises ValueError when a path is both a leaf and
    the parent of other paths."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"tensor {path!r} nests under another tensor's path")
        if isinstance(node.get(leaf), dict):
            raise ValueError(f"tensor {path!r} is also the parent of other tensors")
        node[leaf] = value
    return tree


def unwrap(tree: Mapping[str, Any]) -> Any:
    """The params collection itself: checkpoints of Flax variables (Orbax saves of
    ``{"params": ...}``) nest it one level down, under "params"."""
    if set(tree) == {"params"} and isinstance(tree["params"], Mapping):
        return tree["params"]
    return tree
