"""What reading and writing Orbax checkpoints share: file names, dtypes, the lazy import.

A PyTree checkpoint directory (as `PyTreeCheckpointer` / `StandardCheckpointer` save it) holds
`_METADATA` (the tree), `_CHECKPOINT_METADATA` (step metadata with `custom_metadata`) and the
OCDBT/zarr array store. qmill records the logical dtypes of arrays stored in a carrier in
`custom_metadata["qmill"]["dtypes"]` and the logical shapes of 4-bit arrays packed two codes
per byte in `custom_metadata["qmill"]["packed"]`, Orbax's own slot for user metadata.
"""

from __future__ import annotations

import pathlib
from typing import Any

from qmill.checkpoints.base import dtypes

PYTREE_METADATA = "_METADATA"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
QMILL_KEY = "qmill"

# Stored as themselves: numpy's dtypes and the ml_dtypes tensorstore knows. Orbax refuses the
# others (`Unsupported data type: "uint4"`, also float8_e4m3, uint2, float6_*), which go into
# carriers. dtypes_test round-trips every ml_dtypes type to keep this list honest.
NATIVE = dtypes.NUMPY_NATIVE | frozenset(
    [
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e4m3b11fnuz",
        "float8_e3m4",
        "float8_e8m0fnu",
        "float4_e2m1fn",
        "int4",
    ]
)


def import_orbax() -> Any:
    """orbax.checkpoint, imported on first use: it pulls in jax, which `import qmill.client`
    must not."""
    import orbax.checkpoint as ocp

    return ocp


def find_pytree_dir(path: pathlib.Path) -> pathlib.Path | None:
    """The PyTree checkpoint directory `path` is or holds, without importing Orbax.

    Accepts the PyTree directory itself, or a checkpoint directory holding exactly one PyTree
    item (Orbax's v1 layout `state/`, or a CheckpointManager step with one item like `default/`).
    """
    if not path.is_dir():
        return None
    if (path / PYTREE_METADATA).is_file():
        return path
    if (path / CHECKPOINT_METADATA).is_file():
        items = [p for p in path.iterdir() if (p / PYTREE_METADATA).is_file()]
        if len(items) == 1:
            return items[0]
    return None
