"""A small Hugging Face Llama folder written with numpy (no torch): two bf16 shards and their
index, config.json (tied head) and a tokenizer file. Shapes a compressed-tensors run exercises:
k/v of 64 rows (FP8_BLOCK pads them to a block), q/k/v and gate/up (NVFP4's fused sets), k/v in
another shard than q (NVFP4 stores them in q's).
"""

from __future__ import annotations

import json
import pathlib

import ml_dtypes
import numpy as np
import safetensors.numpy

HIDDEN, INTERMEDIATE, VOCAB, KV = 128, 128, 128, 64
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def write_llama(folder: pathlib.Path) -> pathlib.Path:
    """The source folder: two bf16 shards and their index, config.json and a tokenizer file."""
    rng = np.random.default_rng(35)

    def w(*shape: int) -> np.ndarray:
        return rng.normal(0, 0.05, shape).astype(ml_dtypes.bfloat16)

    layer = "model.layers.0"
    shards = [
        {
            "model.embed_tokens.weight": w(VOCAB, HIDDEN),
            f"{layer}.input_layernorm.weight": np.ones(HIDDEN, ml_dtypes.bfloat16),
            f"{layer}.self_attn.q_proj.weight": w(HIDDEN, HIDDEN),
            f"{layer}.self_attn.o_proj.weight": w(HIDDEN, HIDDEN),
        },
        {
            f"{layer}.self_attn.k_proj.weight": w(KV, HIDDEN),
            f"{layer}.self_attn.v_proj.weight": w(KV, HIDDEN),
            f"{layer}.mlp.gate_proj.weight": w(INTERMEDIATE, HIDDEN),
            f"{layer}.mlp.up_proj.weight": w(INTERMEDIATE, HIDDEN),
            f"{layer}.mlp.down_proj.weight": w(HIDDEN, INTERMEDIATE),
            f"{layer}.post_attention_layernorm.weight": np.ones(HIDDEN, ml_dtypes.bfloat16),
            "model.norm.weight": np.ones(HIDDEN, ml_dtypes.bfloat16),
        },
    ]
    folder.mkdir()
    write_shards(folder, shards, indent=2)
    (folder / "config.json").write_text(json.dumps(CONFIG, indent=2))
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": null}')
    return folder


def write_shards(folder: pathlib.Path, shards: list[dict], *, indent: int | None = None) -> None:
    """`shards` (name -> array each) as a Hugging Face folder's safetensors shards and index."""
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        safetensors.numpy.save_file(shard, folder / name, {"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=indent))
