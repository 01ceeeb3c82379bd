"""The forward pass of a Hugging Face causal LM in JAX, one decoder layer at a time.

Lingo:
  h       the residual stream (B, T, D) float32 entering or leaving a decoder layer.
  stage   a cut of the decoder layer at each group of linears sharing one input: stage k's output
          `carry["x"]` is the input of its linears (q, k, v | o | gate, up | down); the last
          stage has none and leaves the layer's output in `carry["h"]`.
  weights one layer's tensors keyed by names relative to its prefix ("self_attn.q_proj.weight");
          HF Linear weights are (out_features, in_features): y = x @ W.T (+ b).

A stage reads only the linears of earlier stages (and norms and biases), so the layer-by-layer
GPTQ driver can swap those for their quantized versions between stages ("true sequential").
Compute is float32 whatever the weights' dtype; windows are full (positions 0..T-1), causal, with
the sliding window where the config says, and no padding. No file access here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.lm import activations, moe
from qmill.engine.lm import config as config_lib
from qmill.engine.lm import rope as rope_lib

_F32 = jnp.float32
_STAGES = 5  # attn_in, attn_out, mlp_in, mlp_mid, out


@dataclasses.dataclass(frozen=True)
class Stage:
    """One cut of a decoder layer."""

    # What the stage computes, for progress and reports ("attn_in", "attn_out", ...).
    name: str
    # Relative names of the linear weights whose common input this stage produces.
    linears: tuple[str, ...]


def stages(cfg: config_lib.LmConfig, layer: int) -> tuple[Stage, ...]:
    """The decoder layer cut at each group of linears sharing one input (the last: none)."""
    config_lib.layer_prefix(cfg, layer)  # range check
    names = config_lib.relative_linear_names(cfg, layer if cfg.moe else None)
    if config_lib.is_moe_layer(cfg, layer):
        # The block's input (stage 2's x) feeds the router and every expert, each on its own
        # tokens: stage 3 passes it on unchanged, stage 4 is the block (moe.py).
        return (
            Stage("attn_in", names[:3]),
            Stage("attn_out", names[3:4]),
            Stage("moe_in", ()),
            Stage("experts", names[4:]),
            Stage("out", ()),
        )
    if cfg.fused:
        attn, o, mlp, down = names[:1], names[1:2], names[2:3], names[3:]
    else:
        attn, o, mlp, down = names[:3], names[3:4], names[4:6], names[6:]
    return (
        Stage("attn_in", attn),
        Stage("attn_out", o),
        Stage("mlp_in", mlp),
        Stage("mlp_mid", down),
        Stage("out", ()),
    )


def _w(weights: Mapping[str, jax.Array], name: str) -> jax.Array:
    return jnp.asarray(weights[name]).astype(_F32)


def _linear(weights: Mapping[str, jax.Array], name: str, x: jax.Array, bias: bool) -> jax.Array:
    """x @ W.T (+ b) for the HF Linear `name` ("self_attn.q_proj")."""
    y = jnp.einsum("...i,oi->...o", x, _w(weights, name + ".weight"), precision="highest")
    return y + _w(weights, name + ".bias") if bias else y


def _rms_norm(cfg: config_lib.LmConfig | _Ends, x: jax.Array, weight: jax.Array) -> jax.Array:
    """RMSNorm in float32; Gemma's scales by (1 + weight)."""
    x = x.astype(_F32)
    normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    scale = weight.astype(_F32)
    return normed * (1.0 + scale) if cfg.norm_plus_one else scale * normed


def _norm(cfg, weights, name: str, x: jax.Array) -> jax.Array:
    return _rms_norm(cfg, x, jnp.asarray(weights[name + ".weight"]))


def _softcap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else jnp.tanh(x / cap) * cap


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x (B, T, heads, head_dim) rotated on its first cos.shape[-1] channels (rotate_half)."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


def _mask(cfg: config_lib.LmConfig, sliding: bool, queries: jax.Array, keys: jax.Array):
    """(Q, K) bool: the query at position q sees the key at position k when k <= q (and
    q - k < window on sliding layers)."""
    q, k = queries[:, None], keys[None, :]
    allowed = k <= q
    if sliding:
        allowed &= k > q - cfg.sliding_window
    return allowed


def _key_range(cfg: config_lib.LmConfig, sliding: bool, start: int, stop: int) -> range:
    """The keys any query in start..stop-1 can see: none after the last (causal), none before
    the window of the first on a sliding layer."""
    first = max(0, start - cfg.sliding_window + 1) if sliding else 0
    return range(first, stop)


def _qkv(cfg: config_lib.LmConfig, weights, x: jax.Array):
    """q (B, T, H, hd), k and v (B, T, KV, hd) from the attention's input."""
    hd, h, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    if cfg.fused:
        qkv = _linear(weights, "self_attn.qkv_proj", x, False)
        q, k, v = jnp.split(qkv, [h * hd, (h + kv) * hd], axis=-1)
    else:
        q, k, v = (_linear(weights, f"self_attn.{n}_proj", x, cfg.qkv_bias) for n in "qkv")
    b, t = x.shape[:2]
    q, k, v = q.reshape(b, t, h, hd), k.reshape(b, t, kv, hd), v.reshape(b, t, kv, hd)
    if cfg.qk_norm:
        q = _norm(cfg, weights, "self_attn.q_norm", q)
        k = _norm(cfg, weights, "self_attn.k_norm", k)
    return q, k, v


def _attention(cfg: config_lib.LmConfig, sliding: bool, weights, x: jax.Array) -> jax.Array:
    """Causal (grouped-query) self-attention of the normed input x: (B, T, H * head_dim), the
    input of o_proj.

    Queries go in blocks of cfg.attention_chunk, each against only the keys it can see (a
    static slice: the block loop is unrolled), so the scores of the masked-out upper triangle
    are never computed: with blocks of 128 over 512 tokens, 5/8 of the full (T, T) products.
    """
    q, k, v = _qkv(cfg, weights, x)
    b, t = x.shape[:2]
    kv, hd = cfg.num_kv_heads, cfg.head_dim
    groups = cfg.num_heads // kv
    rope = cfg.rope_local if sliding else cfg.rope
    cos, sin = (jnp.asarray(a) for a in rope_lib.cos_sin(rope, hd, t))
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    # Query head j uses key/value head j // groups (transformers' repeat_kv): the groups of a
    # key/value head and the queries of a block are one matrix, so each product is one batched
    # matmul over (B, KV) with no copy of k or v per group.
    q = q.reshape(b, t, kv, groups, hd).transpose(0, 2, 3, 1, 4)  # (B, KV, G, T, hd)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, KV, T, hd)
    outs = []
    for start in range(0, t, cfg.attention_chunk):
        stop = min(start + cfg.attention_chunk, t)
        keys = _key_range(cfg, sliding, start, stop)
        block = q[:, :, :, start:stop].reshape(b, kv, groups * (stop - start), hd)
        out = _attend(
            cfg,
            sliding,
            block,
            k[:, :, keys.start : keys.stop],
            v[:, :, keys.start : keys.stop],
            jnp.arange(start, stop),
            jnp.arange(keys.start, keys.stop),
        )
        outs.append(out.reshape(b, kv, groups, stop - start, hd))
    out = jnp.concatenate(outs, axis=3) if len(outs) > 1 else outs[0]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, cfg.num_heads * hd)


def _attend(cfg, sliding: bool, q, k, v, queries: jax.Array, keys: jax.Array) -> jax.Array:
    """Softmax attention of queries q (B, KV, G * Q, hd), G groups of the Q positions
    `queries`, over the keys k, v (B, KV, K, hd) at positions `keys`."""
    scores = jnp.matmul(q, jnp.swapaxes(k, -1, -2), precision="highest") * cfg.attn_scale
    scores = _softcap(scores, cfg.attn_softcap)
    allowed = _mask(cfg, sliding, jnp.tile(queries, q.shape[2] // queries.shape[0]), keys)
    # The lowest float rather than -inf: its exp is 0 all the same, without inf arithmetic.
    scores = jnp.where(allowed, scores, jnp.finfo(_F32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.matmul(probs, v, precision="highest")


def _act(cfg: config_lib.LmConfig, x: jax.Array) -> jax.Array:
    if cfg.activation == "silu":
        return jax.nn.silu(x)
    return jax.nn.gelu(x, approximate=cfg.activation == "gelu_pytorch_tanh")


def run_stage(
    cfg: config_lib.LmConfig,
    layer: int,
    index: int,
    weights: Mapping[str, jax.Array],
    carry: dict[str, jax.Array],
) -> dict[str, jax.Array]:
    """Stage `index` of decoder layer `layer`: pure, jittable with (cfg, layer, index) static
    (`stage_fn` gives it jitted, one compilation shared by the layers of one kind).

    The first stage takes {"h": (B, T, D) float32}; after a stage with linears, carry["x"] is
    their input and carry["h"] the residual stream so far; after the last, carry["h"] is the
    layer's output (and no "x").
    """
    if config_lib.is_moe_layer(cfg, layer) and index >= 3:
        return _moe_stage(cfg, index, weights, carry)
    return _stage(cfg, _sliding(cfg, layer), index, weights, carry)


def _moe_stage(cfg: config_lib.LmConfig, index: int, weights, carry) -> dict[str, jax.Array]:
    """Stages 3 and 4 of a mixture-of-experts layer (eager: which tokens reach an expert is
    data)."""
    if index == 3:
        return dict(carry)
    if index == 4:
        return {"h": carry["h"].astype(_F32) + moe.block(cfg, weights, carry["x"])}
    raise ValueError(f"stage {index} out of range: a decoder layer has {_STAGES} stages")


def _sliding(cfg: config_lib.LmConfig, layer: int) -> bool:
    """What distinguishes one layer's computation from another's: whether it is a sliding one
    (its mask, and Gemma 3's local rope); the weights are arguments."""
    config_lib.layer_prefix(cfg, layer)  # range check
    return cfg.sliding_layers[layer]


def _stage(cfg: config_lib.LmConfig, sliding: bool, index: int, weights, carry) -> dict:
    h = carry["h"].astype(_F32)
    if index == 0:
        return {"h": h, "x": _norm(cfg, weights, "input_layernorm", h)}
    x = carry["x"].astype(_F32)
    if index == 1:
        return {"h": h, "x": _attention(cfg, sliding, weights, x)}
    if index == 2:
        a = _linear(weights, "self_attn.o_proj", x, cfg.o_bias)
        if cfg.sandwich_norms:
            a = _norm(cfg, weights, "post_attention_layernorm", a)
            h = h + a
            return {"h": h, "x": _norm(cfg, weights, "pre_feedforward_layernorm", h)}
        h = h + a
        return {"h": h, "x": _norm(cfg, weights, "post_attention_layernorm", h)}
    if index == 3:
        if cfg.fused:
            gate, up = jnp.split(_linear(weights, "mlp.gate_up_proj", x, False), 2, axis=-1)
        else:
            gate = _linear(weights, "mlp.gate_proj", x, cfg.mlp_bias)
            up = _linear(weights, "mlp.up_proj", x, cfg.mlp_bias)
        return {"h": h, "x": _act(cfg, gate) * up}
    if index == 4:
        m = _linear(weights, "mlp.down_proj", x, cfg.mlp_bias)
        if cfg.sandwich_norms:
            m = _norm(cfg, weights, "post_feedforward_layernorm", m)
        return {"h": h + m}
    raise ValueError(f"stage {index} out of range: a decoder layer has {_STAGES} stages")


_stage_jit = jax.jit(_stage, static_argnums=(0, 1, 2))


def stage_fn(
    cfg: config_lib.LmConfig, layer: int, index: int
) -> Callable[[Mapping[str, jax.Array], dict[str, jax.Array]], dict[str, jax.Array]]:
    """run_stage(cfg, layer, index, ...) jitted: f(weights, carry) -> carry. Layers of one kind
    (sliding or not) share its compilation, so a 30-layer model compiles each stage once or
    twice, not 30 times (it compiles again for other shapes or weight dtypes)."""
    if not 0 <= index < _STAGES:
        raise ValueError(f"stage {index} out of range: a decoder layer has {_STAGES} stages")
    if config_lib.is_moe_layer(cfg, layer) and index >= 3:
        return functools.partial(_moe_stage, cfg, index)
    return functools.partial(_stage_jit, cfg, _sliding(cfg, layer), index)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _layer(cfg: config_lib.LmConfig, sliding: bool, weights, h: jax.Array) -> jax.Array:
    carry = {"h": h}
    for index in range(_STAGES):
        carry = _stage(cfg, sliding, index, weights, carry)
        if cfg.input_quant is not None and "x" in carry:  # the next stage's linears' input
            carry = {**carry, "x": activations.quantize_dequantize(cfg.input_quant, carry["x"])}
    return carry["h"]


def layer_forward(
    cfg: config_lib.LmConfig, layer: int, weights: Mapping[str, jax.Array], h: jax.Array
) -> jax.Array:
    """Decoder layer `layer` on h (B, T, D) float32: every stage in order, in one jitted call
    (compiled once per kind of layer, as stage_fn; a mixture of experts' block eagerly)."""
    if config_lib.is_moe_layer(cfg, layer):
        carry = {"h": h}
        for index in range(_STAGES):
            carry = stage_fn(cfg, layer, index)(weights, carry)
        return carry["h"]
    return _layer(cfg, _sliding(cfg, layer), weights, h)


@dataclasses.dataclass(frozen=True)
class _Ends:
    """What embed, logits and token_nll read of an LmConfig: their static jit key, so models
    that differ only inside their layers share these compilations."""

    rms_norm_eps: float
    norm_plus_one: bool
    embed_scale: bool
    tied: bool
    final_softcap: float | None


def _ends(cfg: config_lib.LmConfig) -> _Ends:
    return _Ends(cfg.rms_norm_eps, cfg.norm_plus_one, cfg.embed_scale, cfg.tied, cfg.final_softcap)


def embed(cfg: config_lib.LmConfig, outer: Mapping[str, jax.Array], ids: jax.Array) -> jax.Array:
    """The hidden states (B, T, D) float32 entering layer 0 from int32 ids (B, T). Gemma's
    sqrt(D) normalizer is rounded to the embedding's dtype first, as transformers computes it
    (for a bf16 checkpoint: bf16's 8-bit mantissa)."""
    return _embed(_ends(cfg), outer, ids)


@functools.partial(jax.jit, static_argnums=0)
def _embed(ends: _Ends, outer: Mapping[str, jax.Array], ids: jax.Array) -> jax.Array:
    table = jnp.asarray(outer["embed"])
    h = jnp.take(table, ids, axis=0).astype(_F32)
    if ends.embed_scale:
        normalizer = jnp.asarray(np.float32(table.shape[-1] ** 0.5)).astype(table.dtype)
        h = h * normalizer.astype(_F32)
    return h


def _logits(ends: _Ends, outer: Mapping[str, jax.Array], h: jax.Array) -> jax.Array:
    h = _rms_norm(ends, h, jnp.asarray(outer["norm"]))
    head = jnp.asarray(outer["embed"] if ends.tied else outer["head"]).astype(_F32)
    out = jnp.einsum("...d,vd->...v", h, head, precision="highest")
    return _softcap(out, ends.final_softcap)


def logits(cfg: config_lib.LmConfig, outer: Mapping[str, jax.Array], h: jax.Array) -> jax.Array:
    """(B, T, V) float32 from the last layer's h: the final norm, the head (the embedding when
    tied), the final soft-cap."""
    return _logits_jit(_ends(cfg), outer, h)


_logits_jit = jax.jit(_logits, static_argnums=0)
# Logits made at once by token_nll's default chunk: 2**25 floats, 128 MiB.
_LOGITS_BUDGET = 1 << 25


def token_nll(
    cfg: config_lib.LmConfig,
    outer: Mapping[str, jax.Array],
    h: jax.Array,
    ids: jax.Array,
    *,
    chunk: int | None = None,
) -> jax.Array:
    """(B, T-1) float32: -log p(ids[:, t+1] | ids[:, :t+1]) from the last layer's h (B, T, D).

    The logits are made `chunk` positions at a time (a sequential lax.map; by default as many
    as keep them under 128 MiB), so a big vocabulary's (B, T, V) is never held whole. The mean
    is transformers' loss; exp of the mean over a text, its perplexity.
    """
    b, t, _ = h.shape
    if t < 2:
        raise ValueError(f"token_nll needs at least 2 positions, got {t}")
    if chunk is None:
        vocab = outer["embed" if cfg.tied else "head"].shape[0]
        chunk = _LOGITS_BUDGET // (b * vocab)
    return _token_nll(_ends(cfg), max(1, min(chunk, t - 1)), outer, h, ids)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _token_nll(ends: _Ends, chunk: int, outer, h: jax.Array, ids: jax.Array) -> jax.Array:
    b, t, d = h.shape
    n = t - 1
    steps = -(-n // chunk)
    pad = steps * chunk - n
    hs = jnp.pad(h[:, :-1], ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(ids[:, 1:], ((0, 0), (0, pad)))
    hs = hs.reshape(b, steps, chunk, d).transpose(1, 0, 2, 3)
    targets = targets.reshape(b, steps, chunk).transpose(1, 0, 2)

    def one(args):
        hc, tc = args
        lg = _logits(ends, outer, hc)
        picked = jnp.take_along_axis(lg, tc[..., None], axis=-1)[..., 0]
        return jax.nn.logsumexp(lg, axis=-1) - picked

    nll = jax.lax.map(one, (hs, targets))  # (steps, B, chunk)
    return nll.transpose(1, 0, 2).reshape(b, steps * chunk)[:, :n]
