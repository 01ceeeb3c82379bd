"""`--format compressed-tensors`: llm-compressor's schemes as qmill recipes (schemes), a quantized
Linear weight as compressed-tensors stores it (layout), FP8_BLOCK on ragged weights (blocks),
NVFP4's global scales (global_scales), a compressed-tensors folder read back (reader) and written
(writer).

May import: base/, formats/safetensors/, formats/hf_folder/ and itself; the engine's model-free
room inside functions only.
"""
