"""A Hadamard rotation of a causal LM's residual stream, fused into its weights (QuaRot's and
SpinQuant's offline rotation "R1"), then round to nearest or GPTQ: the layer-by-layer
calibration of `--method hadamard|hadamard+gptq`. The output is an ordinary model of the same
architecture: nothing is rotated at inference.

Lingo:
  Q        the rotation, orthogonal (D, D), D the hidden size: diag(signs) · blockdiag(H, ..., H)
           with H the normalized Sylvester Hadamard matrix (entries ±1/√b) of b, the largest
           power of two dividing D (D itself when it is one: SmolLM2's 576 = 9 · 64 takes nine
           blocks of 64), and signs ±1 drawn from the seed.
  reader   a linear whose input is a norm of the residual stream: q/k/v (or qkv_proj) after
           input_layernorm, gate/up (or gate_up_proj) after post_attention_layernorm, the head
           after the final norm. W (out, in) ↦ (W · g) Q, g the norm's scale, folded in.
  writer   a linear that adds into the residual stream: o_proj, down_proj. W ↦ Qᵀ W, b ↦ Qᵀ b.

Why the float model's function is unchanged: the residual stream h becomes h Q everywhere (the
embedding's rows E ↦ E Q start it, each writer adds its output rotated). RMSNorm without a
weight commutes with Q (an orthogonal map keeps the mean of squares), so a reader sees
norm(h Q) = norm(h) Q and norm(h) Q ((W · g) Q)ᵀ = norm(h) (W · g)ᵀ, its output before. Each
norm's weight is moved into its readers and set to one (Gemma's (1 + w) norms: w = 0).

Why it helps quantization: Q mixes each token's channels within a block of b, so an outlier
channel of the residual is spread over b channels at 1/√b of its size: the readers' inputs
(per-token int8 / int4 activations, W8A8, W4A8) lose less to a few large channels, and the
readers' weight columns even out too.

Refused (check): mixtures of experts (the router and every expert would take the rotation:
not done), norms applied to a block's output before the residual add (Gemma 2 / 3's
post_attention_layernorm and post_feedforward_layernorm: norm(o Q) · w is not norm(o) · w
rotated), and blocks under 8 (a hidden size with a small power-of-two factor: too little to
spread an outlier over).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.contrib import gptq_core, hadamard_rot
from qmill.engine.lm import config as config_lib
from qmill.engine.lm import sequential, smoothing
from qmill.engine.modelfree import layout

_F32 = jnp.float32
# The smallest Hadamard block taken (module docstring: Refused).
MIN_BLOCK = 8
# The stored tensors' method names (and the report's).
HADAMARD = "hadamard"


@dataclasses.dataclass(frozen=True, kw_only=True)
class RotationOptions:
    """How the residual stream is rotated."""

    # Seed of Q's random signs: the same seed gives the same bytes on every run.
    seed: int = 0


def block_size(hidden: int) -> int:
    """b: the largest power of two dividing `hidden`.

    Raises:
      ValueError: b < MIN_BLOCK.
    """
    block = hidden & -hidden
    if block < MIN_BLOCK:
        raise ValueError(
            f"a hidden size of {hidden} has a largest power-of-two factor of {block}: Hadamard "
            f"blocks of at least {MIN_BLOCK} are needed to spread outliers; use another method"
        )
    return block


def check(cfg: config_lib.LmConfig) -> None:
    """Refuses a model whose rotation does not fuse into its weights (module docstring).

    Raises:
      ValueError: saying why and what to run instead.
    """
    if cfg.moe is not None:
        raise ValueError(
            f"the Hadamard rotation covers dense models; this {cfg.model_type} model has "
            "experts: use --method gptq (or awq, smoothquant)"
        )
    if cfg.sandwich_norms:
        raise ValueError(
            f"{cfg.model_type} normalizes each block's output before adding it to the residual "
            "stream (post_attention_layernorm, post_feedforward_layernorm): those norms' "
            "weights do not commute with a rotation. Use --method gptq, awq or smoothquant"
        )
    block_size(cfg.hidden_size)


@dataclasses.dataclass(frozen=True)
class Rotation:
    """Q as its parts (module docstring): applied block by block, never as a (D, D) matrix."""

    # (D,) float32: ±1.
    signs: np.ndarray
    # (b, b) float32: H / √b.
    hadamard: np.ndarray

    def matrix(self) -> np.ndarray:
        """Q as a dense (D, D) float64 matrix (for tests and small models)."""
        blocks = len(self.signs) // len(self.hadamard)
        dense = np.kron(np.eye(blocks), self.hadamard.astype(np.float64))
        return self.signs.astype(np.float64)[:, None] * dense


def rotation(hidden: int, seed: int) -> Rotation:
    """Q for a residual stream of width `hidden` (block_size's refusal)."""
    block = block_size(hidden)
    signs = np.random.default_rng(seed).integers(0, 2, hidden) * 2 - 1
    had = hadamard_rot.sylvester(block.bit_length() - 1).astype(np.float64) / np.sqrt(block)
    return Rotation(signs.astype(np.float32), had.astype(np.float32))


@jax.jit
def _times_q(w: jax.Array, signs: jax.Array, had: jax.Array) -> jax.Array:
    """w Q along w's last axis, float32."""
    b = had.shape[0]
    x = (w.astype(_F32) * signs).reshape(*w.shape[:-1], -1, b)
    return jnp.einsum("...nb,bc->...nc", x, had, precision="highest").reshape(w.shape)


@jax.jit
def _q_transposed_times(w: jax.Array, signs: jax.Array, had: jax.Array) -> jax.Array:
    """Qᵀ w along w's first axis, float32."""
    b = had.shape[0]
    scaled = w.astype(_F32) * signs.reshape(-1, *([1] * (w.ndim - 1)))
    x = scaled.reshape(-1, b, *w.shape[1:])
    return jnp.einsum("nb...,bc->nc...", x, had, precision="highest").reshape(w.shape)


def _norm_scale(cfg: config_lib.LmConfig, weight: jax.Array) -> jax.Array:
    """The norm's per-channel factor: w, or Gemma's 1 + w (float32)."""
    w = jnp.asarray(weight).astype(_F32)
    return 1.0 + w if cfg.norm_plus_one else w


def _unit_norm(cfg: config_lib.LmConfig, weight: np.ndarray | jax.Array) -> jax.Array:
    """The norm's weight once its scale has moved into its readers: a factor of one."""
    fill = 0.0 if cfg.norm_plus_one else 1.0
    return jnp.full(np.shape(weight), fill, dtype=jnp.asarray(weight).dtype)


def _groups(cfg: config_lib.LmConfig) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(norm, its readers) of a decoder layer, relative names."""
    if cfg.fused:
        attn, mlp = ("self_attn.qkv_proj.weight",), ("mlp.gate_up_proj.weight",)
    else:
        attn = tuple(f"self_attn.{n}_proj.weight" for n in "qkv")
        mlp = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
    return (("input_layernorm.weight", attn), ("post_attention_layernorm.weight", mlp))


def _writers(cfg: config_lib.LmConfig) -> tuple[str, ...]:
    """The tensors that add into the residual stream: o and down, and their biases."""
    names = ["self_attn.o_proj.weight", "mlp.down_proj.weight"]
    names += ["self_attn.o_proj.bias"] if cfg.o_bias else []
    names += ["mlp.down_proj.bias"] if cfg.mlp_bias else []
    return tuple(names)


def rotate_layer(
    cfg: config_lib.LmConfig,
    weights: Mapping[str, np.ndarray | jax.Array],
    rot: Rotation,
    keep_float32: frozenset[str] = frozenset(),
) -> dict[str, jax.Array]:
    """The tensors of a decoder layer the rotation changes (relative names: norms, readers,
    writers and their biases), each in its own dtype, except those in `keep_float32` (the
    linears about to be quantized: their codes come from the rotated weight itself, not from it
    rounded to a bf16 checkpoint's 8 bits first).

    Raises:
      ValueError: a model `check` refuses.
    """
    check(cfg)
    signs, had = jnp.asarray(rot.signs), jnp.asarray(rot.hadamard)
    out: dict[str, jax.Array] = {}
    for norm, readers in _groups(cfg):
        scale = _norm_scale(cfg, weights[norm])
        for name in readers:
            out[name] = _times_q(jnp.asarray(weights[name]).astype(_F32) * scale, signs, had)
        out[norm] = _unit_norm(cfg, weights[norm])
    for name in _writers(cfg):
        out[name] = _q_transposed_times(jnp.asarray(weights[name]), signs, had)
    return {n: w if n in keep_float32 else w.astype(weights[n].dtype) for n, w in out.items()}


def rotate_outer(
    cfg: config_lib.LmConfig, outer: Mapping[str, jax.Array], rot: Rotation
) -> dict[str, jax.Array]:
    """The embedding, final norm and head rotated, each in its own dtype (a tied head in the
    embedding's): always with a "head", which differs from the embedding now (the final norm's
    scale is in it): the model runs untied (`untied`)."""
    signs, had = jnp.asarray(rot.signs), jnp.asarray(rot.hadamard)
    embed = jnp.asarray(outer["embed"])
    head = embed if cfg.tied else jnp.asarray(outer["head"])
    scaled = head.astype(_F32) * _norm_scale(cfg, outer["norm"])
    return {
        "embed": _times_q(embed, signs, had).astype(embed.dtype),
        "norm": _unit_norm(cfg, outer["norm"]),
        "head": _times_q(scaled, signs, had).astype(head.dtype),
    }


def untied(cfg: config_lib.LmConfig) -> config_lib.LmConfig:
    """`cfg` with its own head: the rotated model's (rotate_outer)."""
    return dataclasses.replace(cfg, tied=False)


def calibrate_layer(
    cfg: config_lib.LmConfig,
    layer: int,
    weights: Mapping[str, np.ndarray | jax.Array],
    hidden: sequential.Hidden,
    plans: Mapping[str, layout.LeafPlan],
    options: RotationOptions,
    gptq: gptq_core.GptqOptions | None,
) -> sequential.LayerCalibration:
    """Rotates decoder layer `layer` and quantizes it: GPTQ with `gptq` in the sequential
    scheme (its Hessians on the rotated inputs), else round to nearest (the next layer's input
    is the float rotated layer's output: smoothing.rtn_layer). `hidden` is the rotated
    residual stream (rotate_outer's embedding starts it).

    The result's `folded` holds the float tensors the rotation changed that are not quantized
    (norms, writers' biases, linears the recipe leaves in float; full names, their own dtype),
    written in place of the source's; `methods` names each quantized linear's method.
    """
    plans = smoothing.scales_in_source_dtype(plans, weights)
    rot = _rotation(cfg.hidden_size, options.seed)
    changed = rotate_layer(cfg, weights, rot, keep_float32=frozenset(plans))
    rotated = {n: jnp.asarray(w) for n, w in weights.items()} | changed
    if gptq is not None:
        done = sequential.calibrate_layer(cfg, layer, rotated, hidden, plans, gptq)
    else:
        done = smoothing.rtn_layer(cfg, layer, rotated, hidden, plans)
    prefix = config_lib.layer_prefix(cfg, layer)
    method = HADAMARD + ("+gptq" if gptq is not None else "")
    return dataclasses.replace(
        done,
        folded={prefix + n: np.asarray(w) for n, w in sorted(changed.items()) if n not in plans},
        methods={prefix + n: method for n in plans},
    )


@functools.lru_cache(maxsize=4)
def _rotation(hidden: int, seed: int) -> Rotation:
    return rotation(hidden, seed)
