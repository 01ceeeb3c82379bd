"""Fixtures for the compressed-tensors tests: a tiny Llama folder written by transformers, and
llm-compressor's model_free_ptq outputs for it (the reference every qmill output must equal).

These tests need the `interop` extra (torch CPU, transformers, compressed-tensors,
llm-compressor); the README's test set-up and CI install it.
"""

from __future__ import annotations

import glob
import json
import pathlib
from typing import Any

import numpy as np
import pytest

from tests import lm_folder

# What qmill leaves in float by default, named as a user of llm-compressor names it in `ignore`.
LLAMA_IGNORE = ["lm_head", "model.embed_tokens"]


def _tiny_llama(
    tmp_path_factory, name: str, *, tied: bool, kv_heads: int = 2, **save
) -> pathlib.Path:
    return lm_folder.write_llama(
        tmp_path_factory.mktemp("llama") / name,
        save=save,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_key_value_heads=kv_heads,
        vocab_size=512,
        tie_word_embeddings=tied,
    )


@pytest.fixture(scope="session")
def llama(tmp_path_factory) -> pathlib.Path:
    """A Llama-architecture folder in bf16 (2 layers, hidden 256), sharded with an index."""
    folder = _tiny_llama(tmp_path_factory, "tiny-llama", tied=False, max_shard_size="1MB")
    assert (folder / "model.safetensors.index.json").exists()
    return folder


@pytest.fixture(scope="session")
def tied_llama(tmp_path_factory) -> pathlib.Path:
    """The same with the output head tied to the embedding (Llama-3.2-1B, Qwen2.5-0.5B, Gemma
    do this): transformers writes no lm_head.weight, one file."""
    folder = _tiny_llama(tmp_path_factory, "tiny-llama-tied", tied=True)
    names = _safetensors_names(folder)
    assert names and "lm_head.weight" not in names
    assert len(list(folder.glob("*.safetensors"))) == 1
    return folder


@pytest.fixture(scope="session")
def one_kv_head_llama(tmp_path_factory) -> pathlib.Path:
    """One key/value head of 64: k_proj and v_proj are (64, 256), a partial 128 x 128 block."""
    return _tiny_llama(tmp_path_factory, "tiny-llama-1kv", tied=False, kv_heads=1)


@pytest.fixture(scope="session")
def mixtral(tmp_path_factory) -> pathlib.Path:
    """A Mixtral-architecture folder (bf16, 4 experts): its router `gate` weights are (4, 256)
    and its k/v projections (64, 256), so FP8_BLOCK's 128 x 128 blocks are ragged there."""
    fields = {
        "hidden_size": 256,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "vocab_size": 512,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
    folder = tmp_path_factory.mktemp("mixtral") / "tiny-mixtral"
    return lm_folder.write(folder, "MixtralConfig", fields, model_class="MixtralForCausalLM")


def _safetensors_names(folder: pathlib.Path) -> list[str]:
    from safetensors import safe_open

    names: list[str] = []
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "np") as f:
            names += list(f.keys())
    return names


@pytest.fixture(scope="session")
def peer(tmp_path_factory):
    """peer(source, scheme, ignore) -> llm-compressor's model_free_ptq output folder (cached)."""
    from llmcompressor import model_free_ptq

    made: dict[Any, pathlib.Path] = {}

    def run(source: pathlib.Path, scheme: str, ignore: list[str]) -> pathlib.Path:
        key = (str(source), scheme, tuple(ignore))
        if key not in made:
            out = tmp_path_factory.mktemp("peer") / f"{source.name}-{scheme}"
            model_free_ptq(str(source), str(out), scheme=scheme, ignore=ignore, max_workers=1)
            made[key] = out
        return made[key]

    return run


def tensors(folder: pathlib.Path) -> dict[str, Any]:
    """Every tensor of a folder's safetensors files, as torch tensors."""
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for path in sorted(glob.glob(str(folder / "*.safetensors"))):
        out.update(load_file(path))
    return out


def same_bits(a: Any, b: Any) -> bool:
    """Equal dtype, shape and bits (NaNs and signed zeros included)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_bytes = (a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return bool(np.array_equal(as_bytes[0].numpy(), as_bytes[1].numpy()))


def quantization_config(folder: pathlib.Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def assert_same_checkpoint(ours: pathlib.Path, theirs: pathlib.Path, *, ignore_list=True) -> None:
    """Same tensors (names, dtypes, shapes, bits), same shards and index, same config."""
    a, b = tensors(ours), tensors(theirs)
    assert sorted(a) == sorted(b)
    unequal = [k for k in a if not same_bits(a[k], b[k])]
    assert not unequal, f"{len(unequal)} tensors differ, e.g. {unequal[:3]}"
    assert sorted(p.name for p in ours.glob("*.safetensors")) == sorted(
        p.name for p in theirs.glob("*.safetensors")
    )
    index = "model.safetensors.index.json"
    # model_free_ptq adds an index to a one-file folder; qmill keeps the source's layout.
    if (ours / index).exists() or len(list(ours.glob("*.safetensors"))) > 1:
        ours_map = json.loads((ours / index).read_text())["weight_map"]
        assert ours_map == json.loads((theirs / index).read_text())["weight_map"]
    qa, qb = quantization_config(ours), quantization_config(theirs)
    if not ignore_list:
        qa.pop("ignore"), qb.pop("ignore")
    assert qa == qb
