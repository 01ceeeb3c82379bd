"""Per-input-channel scales folded into the operation before a group of linears (AWQ,
SmoothQuant), so that the quantized model is an ordinary one: no scale is stored beside a weight.

Lingo:
  fold      one place a decoder layer takes a scale s: the balanced linears' input columns are
            multiplied by s, and the operation producing their input (the smooth side: a norm, or
            the rows of a linear) divides its output by s. In float the layer computes the same
            function (x / s) · (W · s)ᵀ = x · Wᵀ; only the quantization of W · s differs.
  s         float32, one entry per channel of the smooth side's output. Under grouped-query
            attention v_proj's output feeds `groups` query heads' slots of o_proj's input, so o_proj
            takes s repeated per group (`expand`): the fold stays exact.

The table is llm-compressor's mapping table for these architectures (AWQ: four folds per layer;
SmoothQuant: the two norms), with the differences of docs/calibrated-methods.md: v_proj → o_proj
under GQA with the repeated scale (the peer skips it), and Gemma 2/3's MLP fold into
pre_feedforward_layernorm, the norm that feeds gate/up. Weights are relative names as in
engine/lm/forward.py; a fold returns the tensors it changed in their own dtypes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from qmill.engine.lm import config as config_lib

AWQ = "awq"
SMOOTHQUANT = "smoothquant"
METHODS = (AWQ, SMOOTHQUANT)
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fold:
    """One fold of a decoder layer."""

    # "attn_in" (norm → q/k/v), "attn_out" (v → o), "mlp_in" (norm → gate/up), "mlp_mid"
    # (up → down): also the stage (forward.stages) whose output feeds the balanced linears.
    name: str
    # Index of that stage in forward.stages.
    stage: int
    # Relative weight names of the linears whose input columns are multiplied by s.
    balance: tuple[str, ...]
    # The tensor divided by s: a norm's weight, or a linear's weight (its rows `rows`).
    smooth: str
    # "norm" (y = n · w), "norm_plus_one" (Gemma: y = n · (1 + w)) or "linear".
    smooth_kind: str
    # For a linear: the output rows [start, stop) that feed the balanced linears (v of a fused
    # qkv_proj, up of gate_up_proj), and its bias, divided too; None when it has none.
    rows: tuple[int, int] | None = None
    bias: str | None = None
    # Grouped-query attention: (kv_heads, groups, head_dim) of o_proj's input, whose columns
    # (head j = kv · groups + g, dim d) take s[kv, d]; None: s covers the input as it is.
    heads: tuple[int, int, int] | None = None

    @property
    def channels(self) -> int | None:
        """Entries of s when the balanced input is wider (GQA), else None (its width)."""
        return None if self.heads is None else self.heads[0] * self.heads[2]


def table(cfg: config_lib.LmConfig, method: str, layer: int | None = None) -> tuple[Fold, ...]:
    """The folds of a decoder layer for `method`, in forward order (of `layer` when given: a
    mixture of experts' sparse layer takes only the attention's).

    Gemma 3 takes no fold into input_layernorm under AWQ, as in llm-compressor: its q/k norms
    follow q_proj and k_proj, and smoothing them was measured to lose to round to nearest there
    (vllm-project/llm-compressor#2522). On a sparse layer (Mixtral, Qwen2/3-MoE) the norm before
    the MLP feeds the router and every expert: no fold there (one s across all experts is what
    llm-compressor's SmoothQuant leaves out for MoE too), nor into the experts' down_proj.

    Raises:
      ValueError: an unknown method.
    """
    if method not in METHODS:
        raise ValueError(f"smoothing method {method!r} is not one of {METHODS}")
    norm = "norm_plus_one" if cfg.norm_plus_one else "norm"
    hd, h, kv, inter = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    if cfg.fused:
        qkv, mlp = ("self_attn.qkv_proj.weight",), ("mlp.gate_up_proj.weight",)
        v, v_rows, v_bias = "self_attn.qkv_proj.weight", ((h + kv) * hd, (h + 2 * kv) * hd), None
        up, up_rows, up_bias = "mlp.gate_up_proj.weight", (inter, 2 * inter), None
    else:
        qkv = tuple(f"self_attn.{n}_proj.weight" for n in "qkv")
        mlp = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
        v, v_rows = "self_attn.v_proj.weight", (0, kv * hd)
        v_bias = "self_attn.v_proj.bias" if cfg.qkv_bias else None
        up, up_rows = "mlp.up_proj.weight", (0, inter)
        up_bias = "mlp.up_proj.bias" if cfg.mlp_bias else None
    mlp_norm = "pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm"
    attn_in = Fold(
        name="attn_in", stage=0, balance=qkv, smooth="input_layernorm.weight", smooth_kind=norm
    )
    mlp_in = Fold(
        name="mlp_in", stage=2, balance=mlp, smooth=f"{mlp_norm}.weight", smooth_kind=norm
    )
    sparse = layer is not None and config_lib.is_moe_layer(cfg, layer)
    if method == SMOOTHQUANT:
        return (attn_in,) if sparse else (attn_in, mlp_in)
    groups = h // kv
    attn_out = Fold(
        name="attn_out",
        stage=1,
        balance=("self_attn.o_proj.weight",),
        smooth=v,
        smooth_kind="linear",
        rows=v_rows,
        bias=v_bias,
        heads=(kv, groups, hd) if groups > 1 else None,
    )
    mlp_mid = Fold(
        name="mlp_mid",
        stage=3,
        balance=("mlp.down_proj.weight",),
        smooth=up,
        smooth_kind="linear",
        rows=up_rows,
        bias=up_bias,
    )
    first = () if cfg.model_type in ("gemma3", "gemma3_text") else (attn_in,)
    return (*first, attn_out) if sparse else (*first, attn_out, mlp_in, mlp_mid)


def expand(fold: Fold, s: jax.Array) -> jax.Array:
    """s over the balanced linears' input columns (repeated per query head under GQA)."""
    if fold.heads is None:
        return s
    kv, groups, hd = fold.heads
    return jnp.broadcast_to(s.reshape(kv, 1, hd), (kv, groups, hd)).reshape(-1)


def reduce(fold: Fold, per_column: jax.Array) -> jax.Array:
    """A statistic of the balanced input's columns as one per entry of s (GQA: the mean over
    the query heads that share a value head)."""
    if fold.heads is None:
        return per_column
    kv, groups, hd = fold.heads
    return per_column.reshape(kv, groups, hd).mean(axis=1).reshape(-1)


def apply(
    weights: Mapping[str, jax.Array | np.ndarray],
    fold: Fold,
    s: jax.Array,
    keep_float32: frozenset[str] = frozenset(),
) -> dict[str, jax.Array]:
    """The tensors `fold` changes with scale s, each in its own dtype: balanced weights W · s
    (columns), the smooth side divided by s. Computed in float32, rounded once to the dtype,
    except the tensors named in `keep_float32` (the linears about to be quantized: their codes
    come from W · s itself, not from W · s rounded to a bf16 checkpoint's 8 bits first).

    Raises:
      ValueError: s of the wrong length, or not finite and positive.
    """
    host = np.asarray(s, np.float32)
    width = fold.channels or np.shape(weights[fold.balance[0]])[-1]
    if host.shape != (width,):
        raise ValueError(f"{fold.name}: the scale has shape {host.shape}, not ({width},)")
    if not np.all(np.isfinite(host) & (host > 0)):
        raise ValueError(f"{fold.name}: the scale has entries that are not finite and positive")
    names = (*fold.balance, fold.smooth, *((fold.bias,) if fold.bias else ()))
    tensors = {
        n: jnp.asarray(weights[n], jnp.float32 if n in keep_float32 else None) for n in names
    }
    return _apply(fold, tensors, jnp.asarray(host))


@functools.partial(jax.jit, static_argnums=0)
def _apply(fold: Fold, weights: dict[str, jax.Array], s: jax.Array) -> dict[str, jax.Array]:
    full = expand(fold, s)
    out = {name: _scaled_columns(weights[name], full) for name in fold.balance}
    smooth = weights[fold.smooth]
    if fold.smooth_kind == "norm":
        out[fold.smooth] = (smooth.astype(_F32) / s).astype(smooth.dtype)
    elif fold.smooth_kind == "norm_plus_one":
        out[fold.smooth] = ((1.0 + smooth.astype(_F32)) / s - 1.0).astype(smooth.dtype)
    else:
        out[fold.smooth] = _divided_rows(smooth, fold.rows, s)
        if fold.bias is not None:
            out[fold.bias] = _divided_rows(weights[fold.bias], fold.rows, s)
    return out


def _scaled_columns(w: jax.Array, s: jax.Array) -> jax.Array:
    return (w.astype(_F32) * s).astype(w.dtype)


def _divided_rows(w: jax.Array, rows: tuple[int, int] | None, s: jax.Array) -> jax.Array:
    """w (out, ...) with its rows [start, stop) divided by s (one per row)."""
    start, stop = rows if rows is not None else (0, w.shape[0])
    if stop - start != s.shape[0]:
        raise ValueError(f"rows [{start}, {stop}) do not match a scale of {s.shape[0]} entries")
    part = w[start:stop].astype(_F32)
    part = part / (s[:, None] if w.ndim == 2 else s)
    return w.at[start:stop].set(part.astype(w.dtype))
