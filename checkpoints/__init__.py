"""Checkpoint I/O for the qmill client: read tensors one at a time, write a quantized checkpoint.

Formats: Orbax PyTree checkpoints (directories), safetensors (one file, or a sharded set with a
`*.safetensors.index.json`) and .npz archives. `open_source` detects the format; `create_writer`
writes one. Memory stays bounded by a few tensors on both sides, whatever the checkpoint's size.

Paths: '/'-joined tree keys for Orbax and npz ("params/Dense_0/kernel"), the key verbatim for
safetensors. One key layout in every format: a quantized leaf P is written in the Qwix PTQ param
layout as P/array/qvalue, P/array/scale and P/array/zero_point, always '/'-joined, P being the
source's own path (a safetensors name keeps its dots: "model.layers.0.mlp.up_proj.weight/array/
qvalue"); a nested {"array": {...}} under P in Orbax. `load` reads any output back as the nested
tree a PtqProvider model takes.

Atomic outputs: a writer stages its output beside the destination (`.NAME.qmill-tmp-*`) and
renames it into place on commit; on an exception the staged output is deleted. An existing
destination is refused unless `overwrite=True`.

4-bit types (int4, uint4, float4_e2m1fn; nf4 codes are uint4) are packed two codes per byte, low
nibble first, as the wire carries them, in every format: a flat uint8 array of ceil(n / 2)
bytes. Other dtypes a format cannot store (float8_e4m3 in Orbax; bfloat16 and float8 in npz;
...) go into carriers: 2-bit integers as int8 / uint8 with the same values, one per byte;
others as their raw bits in the unsigned integer of their width. The logical dtype, and the
logical shape of packed tensors, are recorded beside the data -- safetensors:
`__metadata__["qmill.dtypes"]` and `["qmill.packed"]`; Orbax: `_CHECKPOINT_METADATA`
custom_metadata `{"qmill": {"dtypes": ..., "packed": ...}}`; npz: `__qmill_dtypes__` and
`__qmill_packed__` members -- each a JSON map from path to dtype name or shape, and the readers
give the original arrays back. bfloat16 and float8_e4m3fn/e5m2 are native in Orbax and
safetensors. Files qmill wrote before packing (4-bit one value per byte) still read back.

`import qmill.checkpoints` does not import jax or Orbax; opening or writing an Orbax
checkpoint imports them.
"""

from qmill.checkpoints.base.protocols import CheckpointWriter as CheckpointWriter
from qmill.checkpoints.base.protocols import TensorEntry as TensorEntry
from qmill.checkpoints.base.protocols import TensorSource as TensorSource
from qmill.checkpoints.formats.registry import FORMATS as FORMATS
from qmill.checkpoints.formats.registry import create_writer as create_writer
from qmill.checkpoints.formats.registry import format_for_destination as format_for_destination
from qmill.checkpoints.formats.registry import open_source as open_source
from qmill.checkpoints.loading.loader import load as load

__all__ = [
    "FORMATS",
    "CheckpointWriter",
    "TensorEntry",
    "TensorSource",
    "create_writer",
    "format_for_destination",
    "load",
    "open_source",
]
