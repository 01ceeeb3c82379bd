"""qmill's own model-free path: quantizing a checkpoint tensor by tensor, with no model code.

Recipes say which tensor gets which qtype and tile (recipes), the storage layout decides how a
tensor's axes are tiled (layout), one jitted call quantizes one tensor and measures its error
(leaf), with 4-bit codes packed in it as checkpoints store them (packing). This is what the
server and the in-process CLI run for `qmill quantize`; it builds on engine.core only, never on
the providers.
"""
