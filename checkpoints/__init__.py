"""Checkpoint I/O for the qmill client: read tensors one at a time, write a quantized checkpoint.

Formats: Orbax PyTree checkpoints (directories), safetensors (one file, or a sharded set with a
`*.safetensors.index.json`) and .npz archives. `open_source` detects the format; `create_writer`
writes one. Memory stays bounded by a few tensors on both sides, whatever the checkpoint's size.

Paths: '/'-joined tree keys for Orbax and npz ("params/Dense_0/kernel"), the key verbatim for
safetensors. A quantized leaf P is written in the Qwix PTQ param layout (P/array/qvalue,
P/array/scale, P/array/zero_point; with "." for safetensors): a nested {"array": {...}} under P
in Orbax.

Atomic outputs: a writer stages its output beside the destination (`.NAME.qmill-tmp-*`) and
renames it into place on commit; on an exception the staged output is deleted. An existing
destination is refused unless `overwrite=True`.

Dtypes a format cannot store (uint4 and float8_e4m3 in Orbax; bfloat16, float8 and int4 in
npz; int4, uint4 and float4 in safetensors): 4-bit (and 2-bit) integers are stored as int8 /
uint8 with the same values, one per byte; other types as their raw bits in the unsigned integer
of their width. The logical dtype is recorded beside the data -- safetensors:
`__metadata__["qmill.dtypes"]`, Orbax: `_CHECKPOINT_METADATA` custom_metadata
`{"qmill": {"dtypes": ...}}`, npz: a `__qmill_dtypes__` member -- each a JSON map from path to
dtype name, and the readers give the original dtype back. bfloat16 and float8_e4m3fn/e5m2 are
native in Orbax and safetensors; int4 is native in Orbax.

`import qmill.checkpoints` does not import jax or Orbax; opening or writing an Orbax
checkpoint imports them.
"""

from qmill.checkpoints.formats import FORMATS as FORMATS
from qmill.checkpoints.formats import create_writer as create_writer
from qmill.checkpoints.formats import format_for_destination as format_for_destination
from qmill.checkpoints.formats import open_source as open_source
from qmill.checkpoints.protocols import CheckpointWriter as CheckpointWriter
from qmill.checkpoints.protocols import TensorEntry as TensorEntry
from qmill.checkpoints.protocols import TensorSource as TensorSource

__all__ = [
    "FORMATS",
    "CheckpointWriter",
    "TensorEntry",
    "TensorSource",
    "create_writer",
    "format_for_destination",
    "open_source",
]
