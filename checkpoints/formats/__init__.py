"""The checkpoint formats, one room each (a reader and a writer, and what they share):

- safetensors/: the file layout (header), one file or a sharded set in (source) and out (writer).
- orbax/: Orbax PyTree checkpoints in and out (orbax and jax imported on use).
- npz/: .npz archives in and out.
- hf_folder/: Hugging Face model folders (config.json, tokenizer and other files, safetensors
  weights) in and out, and the `quantization_config` qmill records in config.json.
- compressed_tensors/: `--format compressed-tensors`, the layout vLLM, SGLang and transformers
  load: the schemes (W4A16, ...), the tensor layout, FP8_BLOCK's padded blocks, NVFP4's global
  scales, a reader and a writer.

Beside the rooms, `registry` says which format a path holds and opens its reader or writer, and
`examples` writes the small example checkpoint in any format.

May import: base/ and the format rooms below a room (safetensors, orbax, npz ← base;
hf_folder ← safetensors; compressed_tensors ← safetensors, hf_folder; registry and examples ←
every room); the engine only inside functions (compressed_tensors plans its tensors with it).
Never the run, loading, lm or programs rooms.
"""
