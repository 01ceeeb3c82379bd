"""Hugging Face model folders: config.json, safetensors weights (+ index) and every other file in,
the same folder out (folder), and the `quantization_config` qmill writes into config.json
(quantization_config).

May import: base/, formats/safetensors/ and itself.
"""
