"""A small Hugging Face Llama folder that transformers writes (bf16, tied head), for the tests of
language-model calibration through a server and as a job; and a character-level tokenizer.json
for it, so `--calibration-text` can be tried without a real model's tokenizer.

Needs the `interop` extra (torch CPU, transformers); callers skip without it.
"""

from __future__ import annotations

import pathlib

VOCAB = 256
LAYERS = 3


def write_llama(folder: pathlib.Path) -> pathlib.Path:
    """Writes the folder (3 layers, hidden 64, vocabulary 256) and returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


def write_char_tokenizer(folder: pathlib.Path) -> None:
    """A tokenizer.json giving each printable ASCII character its code as id (others: 0)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {chr(i): i for i in range(32, 127)} | {"[UNK]": 0}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.save(str(folder / "tokenizer.json"))
