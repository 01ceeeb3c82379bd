"""Writes the inputs the README's examples name, into the current directory.

    python examples/make_inputs.py

- model.safetensors  the example tensors (examples/tiny-mlp's) as one safetensors file
- ckpt/              the same as an Orbax checkpoint directory
- tiny-bert/         a small Hugging Face model folder: config.json, tokenizer files,
                     1_Pooling/, README.md and two safetensors shards with their index
- cnn.npz            float params of the server's built-in `cnn` model (config {"hidden": 64})
- digits.npy         calibration inputs for it (8x8 digit images, batch first); more.npy: more
- tiny-llama/        a two-layer Llama folder (random weights, bf16) with its own tokenizer.json,
                     and llama-calib.txt / llama-eval.txt: text to calibrate it on and to
                     measure its perplexity on (for `qmill quantize ... --method gptq`)

Every file is the same on every run (fixed seeds). Existing files are replaced.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import safetensors.numpy

from qmill.checkpoints.formats import examples

_BERT_CONFIG = {
    "architectures": ["BertModel"],
    "hidden_size": 64,
    "intermediate_size": 256,
    "model_type": "bert",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 128,
}


def tiny_bert(folder: pathlib.Path) -> None:
    """A two-layer BERT-shaped folder with random weights, sharded the way the Hub shards."""
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "1_Pooling").mkdir(parents=True)
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return rng.normal(0, 0.05, shape).astype(np.float32)

    h, ff = _BERT_CONFIG["hidden_size"], _BERT_CONFIG["intermediate_size"]
    shards: list[dict[str, np.ndarray]] = [
        {
            "embeddings.word_embeddings.weight": w(_BERT_CONFIG["vocab_size"], h),
            "embeddings.LayerNorm.weight": np.ones(h, np.float32),
            "embeddings.LayerNorm.bias": np.zeros(h, np.float32),
        },
        {},
    ]
    for layer in range(_BERT_CONFIG["num_hidden_layers"]):
        p = f"encoder.layer.{layer}."
        for name in ("query", "key", "value"):
            shards[layer][p + f"attention.self.{name}.weight"] = w(h, h)
            shards[layer][p + f"attention.self.{name}.bias"] = np.zeros(h, np.float32)
        shards[layer][p + "intermediate.dense.weight"] = w(ff, h)
        shards[layer][p + "output.dense.weight"] = w(h, ff)
    weight_map = {}
    for i, tensors in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        safetensors.numpy.save_file(tensors, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    total = sum(a.nbytes for tensors in shards for a in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps(_BERT_CONFIG, indent=2) + "\n")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", *(f"tok{i}" for i in range(124))]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (folder / "tokenizer_config.json").write_text('{"do_lower_case": true}\n')
    (folder / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}\n')
    (folder / "README.md").write_text("# tiny-bert\n\nRandom weights, for qmill's examples.\n")


_WORDS = (
    "the",
    "a",
    "model",
    "layer",
    "weight",
    "scale",
    "group",
    "token",
    "text",
    "news",
    "market",
    "city",
    "people",
    "year",
    "water",
    "report",
    "said",
    "will",
    "would",
    "could",
    "new",
    "old",
    "first",
    "last",
    "small",
    "large",
    "early",
    "late",
    "north",
    "south",
    "council",
    "government",
    "police",
    "court",
    "school",
    "river",
    "road",
    "train",
    "ship",
    "plane",
    "storm",
    "fire",
    "rain",
)


def _text(rng: np.random.Generator, sentences: int) -> str:
    lines = []
    for _ in range(sentences):
        words = rng.choice(_WORDS, size=int(rng.integers(6, 16)))
        lines.append(" ".join(words).capitalize() + ".")
    return "\n".join(lines) + "\n"


def tiny_llama(folder: pathlib.Path, directory: pathlib.Path) -> None:
    """A two-layer Llama folder (random bf16 weights, a BPE tokenizer.json trained on the text
    written beside it) and two texts: llama-calib.txt and llama-eval.txt."""
    import ml_dtypes
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = np.random.default_rng(0)
    calib, held_out = _text(rng, 600), _text(rng, 200)
    (directory / "llama-calib.txt").write_text(calib)
    (directory / "llama-eval.txt").write_text(held_out)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=256, special_tokens=["<unk>"], show_progress=False)
    tokenizer.train_from_iterator(calib.splitlines(), trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    hidden, inner, layers, vocab = 64, 128, 2, tokenizer.get_vocab_size()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inner,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (hidden // 2, hidden),
            p + "self_attn.v_proj.weight": (hidden // 2, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inner, hidden),
            p + "mlp.up_proj.weight": (inner, hidden),
            p + "mlp.down_proj.weight": (hidden, inner),
        }
    tensors = {
        name: (np.ones(shape) if len(shape) == 1 else rng.normal(0, 0.08, shape)).astype(
            ml_dtypes.bfloat16
        )
        for name, shape in shapes.items()
    }
    safetensors.numpy.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def cnn_inputs(directory: pathlib.Path) -> None:
    import jax

    from qmill.engine import zoo

    try:  # scikit-learn (the dev extra) ships the 8x8 digits; else images of noise will do
        from sklearn.datasets import load_digits

        images = (load_digits().images / 16.0).astype(np.float32)[..., None][:128]
    except ImportError:
        images = np.random.default_rng(0).uniform(0, 1, (128, 8, 8, 1)).astype(np.float32)
    params = zoo.BUILTIN["cnn"].build(zoo.CnnConfig(hidden=64)).init(jax.random.key(0), images[:1])
    # An npz of Flax params as a training script saves them: '/'-joined tree keys.
    flat = {
        f"params/{layer}/{name}": np.asarray(value)
        for layer, leaves in params["params"].items()
        for name, value in leaves.items()
    }
    np.savez(directory / "cnn.npz", **flat)
    np.save(directory / "digits.npy", images[:96])
    np.save(directory / "more.npy", images[96:])


def main() -> None:
    here = pathlib.Path.cwd()
    examples.write_example_checkpoint(here / "model.safetensors", "safetensors", overwrite=True)
    examples.write_example_checkpoint(here / "ckpt", "orbax", overwrite=True)
    tiny_bert(here / "tiny-bert")
    cnn_inputs(here)
    tiny_llama(here / "tiny-llama", here)
    print(
        "wrote model.safetensors, ckpt/, tiny-bert/, cnn.npz, digits.npy, more.npy, tiny-llama/, "
        "llama-calib.txt, llama-eval.txt"
    )


if __name__ == "__main__":
    main()
