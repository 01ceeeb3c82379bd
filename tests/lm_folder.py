"""Small Hugging Face language-model folders that transformers writes (bf16, seeded: the same
weights every run), the tests' one place for them: the Llama of the language-model calibration
tests (3 layers, hidden 64, tied head), the compressed-tensors tests' Llamas and Mixtral
(tests/interop/conftest.py), any family by its config class (lm_architectures_test.py); the
config fields they start from (SMALL, also the forward pass's tests'); token ids; and a
character-level tokenizer.json, so `--calibration-text` can be tried without a real model's
tokenizer.

Writing a folder needs the `interop` extra (torch CPU, transformers); callers skip without it.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np

VOCAB = 256
LAYERS = 3
# A small causal LM's config fields (transformers' names).
SMALL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
}
# Mixtures of experts (their shared fields; each test sets the experts per token).
MOE_SMALL = dict(SMALL, intermediate_size=96)
MIXTRAL = dict(MOE_SMALL, num_local_experts=4)
# Layer 0 a dense MLP (mlp_only_layers), layer 1 sparse; probabilities renormalized.
QWEN3_MOE = dict(
    MOE_SMALL,
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=8,
    norm_topk_prob=True,
    mlp_only_layers=[0],
)


def write(
    folder: pathlib.Path,
    config_class: str,
    fields: dict[str, Any],
    *,
    model_class: str | None = None,
    **save: Any,
) -> pathlib.Path:
    """A folder of `config_class(**fields)`'s causal LM in bf16 (`model_class`, or transformers'
    AutoModelForCausalLM with eager attention), weights drawn from seed 0; `save`:
    save_pretrained's options (max_shard_size=...). Returns the folder."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**fields)
    if model_class is None:
        auto = transformers.AutoModelForCausalLM
        model = auto.from_config(config, attn_implementation="eager")
    else:
        model = getattr(transformers, model_class)(config)
    model.to(torch.bfloat16).save_pretrained(folder, **save)
    return folder


def write_llama(folder: pathlib.Path, *, save: dict | None = None, **fields: Any) -> pathlib.Path:
    """A Llama folder: 3 layers, hidden 64, vocabulary 256, the head tied to the embedding,
    unless `fields` say otherwise."""
    fields = {**SMALL, "num_hidden_layers": LAYERS, "tie_word_embeddings": True, **fields}
    return write(folder, "LlamaConfig", fields, model_class="LlamaForCausalLM", **(save or {}))


def write_ids(root: pathlib.Path, shapes: dict[str, tuple[int, int]]) -> dict[str, pathlib.Path]:
    """Random token ids below VOCAB, one .npy per name ({name: (windows, tokens)}), seed 0."""
    rng = np.random.default_rng(0)
    out = {}
    for name, shape in shapes.items():
        out[name] = root / f"{name}.npy"
        np.save(out[name], rng.integers(0, VOCAB, shape).astype(np.int32))
    return out


def write_char_tokenizer(folder: pathlib.Path) -> None:
    """A tokenizer.json giving each printable ASCII character its code as id (others: 0)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {chr(i): i for i in range(32, 127)} | {"[UNK]": 0}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.save(str(folder / "tokenizer.json"))
