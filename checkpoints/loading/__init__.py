"""Reading a quantized checkpoint (any format qmill or llm-compressor wrote) back as the param
tree a Qwix PtqProvider model takes (loader; `qmill.checkpoints.load`).

May import: base/, formats/ (every room) and itself; orbax and jax inside functions only.
"""
