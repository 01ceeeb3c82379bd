"""The reference's providers: one quantization mode per module, and the entry points that run them.

PTQ, QT, LoRA and the two ODML modes, each a QuantizationProvider (base) that takes over the ops
of a model; quantize_model (model) runs a model under one, qconfig is the reference's name for
the rule/provider pair, and checkpoint_utils restores prequantized params. Built on core,
modeling and ops.
"""
