"""What every format and the run share: the source and writer protocols (protocols, source_base,
writer_base), how tensors are stored when a format cannot hold them (dtypes), the checks on
source files (files), reusable read buffers (buffers), the pipeline's one exception (errors) and
atomic placement of an output (staging).

May import: numpy, ml_dtypes and itself; no other room of qmill.checkpoints.
"""
