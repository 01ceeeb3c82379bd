"""A tiny transformers model and ours side by side, for the forward pass's tests (dense in
forward_test.py, mixtures of experts in moe_test.py): what its saved folder holds, its logits
and loss on random ids, and our hidden state from the same tensors."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jax.numpy as jnp
import numpy as np

from qmill.engine.lm import config as config_lib
from qmill.engine.lm import forward

B, T = 2, 16


def save(model, folder: pathlib.Path) -> tuple[dict, dict[str, np.ndarray]]:
    """`model` saved to `folder` as a user's Hugging Face folder: its config.json and tensors."""
    from safetensors.numpy import load_file

    model.eval().save_pretrained(folder)
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(path))
    return json.loads((folder / "config.json").read_text()), tensors


def theirs(model, cfg: config_lib.LmConfig):
    """(ids, transformers' output with its loss) on B × T random ids (seeded)."""
    import torch

    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    with torch.no_grad():
        out = model(torch.from_numpy(ids).long(), labels=torch.from_numpy(ids).long())
    return ids, out


def outer_weights(cfg, tensors: dict[str, np.ndarray]) -> dict[str, jnp.ndarray]:
    names = config_lib.outer_tensor_names(cfg)
    return {k: jnp.asarray(tensors[v]) for k, v in names.items() if v is not None}


def layer_weights(cfg, i: int, tensors: dict[str, np.ndarray]) -> dict[str, jnp.ndarray]:
    prefix = config_lib.layer_prefix(cfg, i)
    return {
        n[len(prefix) :]: jnp.asarray(tensors[n]) for n in config_lib.layer_tensor_names(cfg, i)
    }


def ours(cfg, tensors: dict[str, np.ndarray], ids: np.ndarray):
    """(the outer weights, our last hidden state) for `ids`, layer by layer."""
    outer = outer_weights(cfg, tensors)
    h = forward.embed(cfg, outer, jnp.asarray(ids))
    for i in range(cfg.num_layers):
        h = forward.layer_forward(cfg, i, layer_weights(cfg, i, tensors), h)
    return outer, h


@dataclasses.dataclass(frozen=True)
class Compared:
    """Theirs and ours on the same random ids."""

    cfg: config_lib.LmConfig
    ids: np.ndarray
    out: Any  # transformers' output: logits, loss
    outer: dict[str, jnp.ndarray]
    h: jnp.ndarray  # our last hidden state
    # max |our logit - theirs| / max |their logit|
    logits_error: float

    def token_nll(self, **kwargs: Any) -> np.ndarray:
        return np.asarray(
            forward.token_nll(self.cfg, self.outer, self.h, jnp.asarray(self.ids), **kwargs)
        )


def compare(model, config: dict, tensors: dict[str, np.ndarray]) -> Compared:
    """transformers' `model` and our forward pass on its saved `config` and `tensors`."""
    cfg = config_lib.from_hf_config(config)
    ids, out = theirs(model, cfg)
    outer, h = ours(cfg, tensors, ids)
    logits = np.asarray(forward.logits(cfg, outer, h))
    reference = out.logits.numpy()
    error = float(np.abs(logits - reference).max() / np.abs(reference).max())
    return Compared(cfg, ids, out, outer, h, error)


def tensor_names(cfg: config_lib.LmConfig) -> set[str]:
    """Every tensor our forward pass reads."""
    names = {n for i in range(cfg.num_layers) for n in config_lib.layer_tensor_names(cfg, i)}
    return names | {n for n in config_lib.outer_tensor_names(cfg).values() if n is not None}
