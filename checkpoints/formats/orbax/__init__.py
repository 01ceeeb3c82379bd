"""Orbax PyTree checkpoints in and out: what both sides share (layout), a leaf-by-leaf reader
(source) and an incremental writer (writer). Orbax and jax are imported on first use.

May import: base/ and itself; orbax and jax inside functions.
"""
