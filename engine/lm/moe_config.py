"""The mixture-of-experts block of a config.json (Mixtral, Qwen2-MoE, Qwen3-MoE), and the
names of its tensors as the checkpoint on disk has them.

transformers 5 fuses a layer's experts into 3-D parameters when it loads a model, but
save_pretrained writes them back one 2-D Linear weight per expert, which is what qmill reads and
writes: Mixtral `block_sparse_moe.experts.{e}.w1|w3|w2.weight` (gate, up, down) and its router
`block_sparse_moe.gate.weight`; Qwen `mlp.experts.{e}.gate_proj|up_proj|down_proj.weight` and
`mlp.gate.weight`, with Qwen2-MoE's shared expert `mlp.shared_expert.*` gated by
`mlp.shared_expert_gate.weight`. Routers and the shared expert's gate are never quantized.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Moe:
    """The sparse MLP block: softmax over the router's logits, the top k experts, their SwiGLU
    outputs weighted by those probabilities (renormalized to sum to 1 when `normalize`)."""

    num_experts: int
    top_k: int
    # Width of each expert's hidden layer.
    intermediate_size: int
    # The top-k probabilities divided by their sum (Mixtral always; Qwen's norm_topk_prob).
    normalize: bool
    # Per decoder layer: whether its MLP is this block (Qwen's mlp_only_layers and
    # decoder_sparse_step leave some layers a dense MLP of the config's intermediate_size).
    layers: tuple[bool, ...]
    # The block's name in a layer ("block_sparse_moe." or "mlp.").
    block: str
    # An expert's gate, up and down linears.
    projections: tuple[str, str, str]
    # Qwen2-MoE's shared expert's hidden width (every token, gated by a sigmoid); 0: none.
    shared_intermediate_size: int = 0


def from_hf(arch: str, c: Mapping[str, Any], layers: int) -> Moe | None:
    """The Moe of a config (transformers' defaults filled in), None for a dense model.

    Raises:
      ValueError: a routing it cannot honour (top k outside 1..experts).
    """
    if arch not in MOE_TYPES:
        return None
    experts = int(c.get("num_local_experts") or c.get("num_experts") or 0)
    top_k = int(c["num_experts_per_tok"])
    if not 1 <= top_k <= experts:
        raise ValueError(f"{arch}: num_experts_per_tok {top_k} outside 1..{experts} experts")
    if arch == "mixtral":
        return Moe(
            num_experts=experts,
            top_k=top_k,
            intermediate_size=int(c["intermediate_size"]),
            normalize=True,
            layers=(True,) * layers,
            block="block_sparse_moe.",
            projections=("w1", "w3", "w2"),
        )
    dense = set(c.get("mlp_only_layers") or ())
    step = int(c.get("decoder_sparse_step", 1))
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    return Moe(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=int(c["moe_intermediate_size"]),
        normalize=bool(c.get("norm_topk_prob", False)),
        layers=sparse,
        block="mlp.",
        projections=("gate_proj", "up_proj", "down_proj"),
        shared_intermediate_size=int(c.get("shared_expert_intermediate_size") or 0)
        if arch == "qwen2_moe"
        else 0,
    )


def router(moe: Moe) -> str:
    """The router's weight (experts, hidden), relative to the layer's prefix."""
    return f"{moe.block}gate.weight"


def shared_gate(moe: Moe) -> str:
    """Qwen2-MoE's shared expert's gate weight (1, hidden)."""
    return f"{moe.block}shared_expert_gate.weight"


def expert(moe: Moe, e: int | str) -> tuple[str, str, str]:
    """Expert e's gate, up and down weights ("shared" for the shared expert)."""
    base = f"{moe.block}shared_expert." if e == "shared" else f"{moe.block}experts.{e}."
    return tuple(f"{base}{p}.weight" for p in moe.projections)  # type: ignore[return-value]


def experts(moe: Moe) -> tuple[int | str, ...]:
    """The experts of a block: 0..E-1, then "shared" where there is one."""
    shared: tuple[str, ...] = ("shared",) if moe.shared_intermediate_size else ()
    return (*range(moe.num_experts), *shared)


def linear_names(moe: Moe) -> tuple[str, ...]:
    """Every quantizable linear of the block: each expert's gate, up, down."""
    return tuple(n for e in experts(moe) for n in expert(moe, e))


def tensor_names(moe: Moe) -> tuple[str, ...]:
    """Every tensor of the block: its linears, the router (and the shared expert's gate)."""
    extra = (shared_gate(moe),) if moe.shared_intermediate_size else ()
    return (*linear_names(moe), router(moe), *extra)
