"""What the forward pass of a Hugging Face causal LM needs, read from its config.json.

`from_hf_config` turns the config.json dict into one frozen, hashable `LmConfig` (a static jit
argument) and refuses, before any work, an architecture or a feature it cannot honour. It reads
both the transformers 4 spelling (`rope_theta` + `rope_scaling`) and the transformers 5 one
(`rope_parameters`, per layer type for Gemma 3), with the defaults of transformers' own config
classes where a field is missing (Gemma 3's nested `text_config` leaves most of them out).

The names here are the checkpoint's: full HF tensor names, which the layer-by-layer driver reads
from safetensors one decoder layer at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from qmill.engine.lm import moe_config, rope_config
from qmill.engine.lm.rope_config import ROPE_TYPES as ROPE_TYPES
from qmill.engine.lm.rope_config import Rope as Rope

SUPPORTED: tuple[str, ...] = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gemma3",
    *moe_config.MOE_TYPES,
)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
_GEMMA = ("gemma", "gemma2", "gemma3_text")
_float_or_none = rope_config.float_or_none  # a config.json number or null
# transformers' config-class defaults of the fields a config.json may leave out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu"},
    "mistral": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "sliding_window": 4096},
    "qwen2": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_window_layers": 28},
    "qwen3": {
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "max_window_layers": 28,
        "head_dim": 128,
    },
    "phi3": {"rms_norm_eps": 1e-5, "tie_word_embeddings": False},
    "mixtral": {
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "sliding_window": None,
        "rope_theta": 1e6,
    },
    "qwen2_moe": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_window_layers": 28},
    "qwen3_moe": {"rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    "gemma": {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "head_dim": 256},
    "gemma2": {
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "gemma3_text": {
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "max_position_embeddings": 131_072,
    },
}
# A mixture of experts' attention and norms are those of its dense sibling.
_DENSE_OF = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class InputQuant:
    """Dynamic quantization of a linear's input: a scale per token, or per group of features."""

    # The codes' qtype: "int8" or "float8_e4m3fn" (symmetric, absmax, PyTorch's arithmetic).
    qtype: str
    # Features per scale along the last axis; None: one scale per token (all of them).
    group: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LmConfig:
    """Everything the forward pass needs; hashable, so it is a static jit argument."""

    # config.json's model_type ("gemma3" when the text model was nested in text_config).
    model_type: str
    # Width of the residual stream (D).
    hidden_size: int
    # Width of the MLP's hidden layer.
    intermediate_size: int
    # Number of decoder layers.
    num_layers: int
    # Query heads, key/value heads (grouped-query attention when fewer), width of a head.
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Rows of the embedding (and of the output head).
    vocab_size: int
    # RMSNorm's epsilon.
    rms_norm_eps: float
    # MLP activation of the gate: "silu" | "gelu_pytorch_tanh" | "gelu" (exact erf).
    activation: str
    # The output head is the embedding matrix (no lm_head.weight in the checkpoint).
    tied: bool
    # q_proj, k_proj and v_proj have biases (Qwen2; attention_bias of Llama, Qwen3, Gemma).
    qkv_bias: bool = False
    # o_proj has a bias (attention_bias of Llama, Qwen3, Gemma).
    o_bias: bool = False
    # gate/up/down have biases (Llama's mlp_bias).
    mlp_bias: bool = False
    # RMSNorm over each head's q and k before the rotation (Qwen3, Gemma 3).
    qk_norm: bool = False
    # RMSNorm multiplies by (1 + weight), computed in float32 (Gemma).
    norm_plus_one: bool = False
    # The embedding is multiplied by sqrt(hidden_size), rounded to the embedding's dtype (Gemma).
    embed_scale: bool = False
    # Attention scores pass through cap * tanh(score / cap) before the mask (Gemma 2).
    attn_softcap: float | None = None
    # Logits pass through cap * tanh(logit / cap) (Gemma 2).
    final_softcap: float | None = None
    # Norms after the attention and after the MLP too, besides before each (Gemma 2 and 3).
    sandwich_norms: bool = False
    # Keys further back than this many positions are masked on sliding layers; None = never.
    sliding_window: int | None = None
    # Per layer: whether it is a sliding-window layer.
    sliding_layers: tuple[bool, ...] = ()
    # Scores are q.k times this: head_dim**-0.5, or query_pre_attn_scalar**-0.5 (Gemma 2, 3).
    attn_scale: float = 1.0
    # Rotary embedding of full-attention layers, and of sliding layers (Gemma 3's local base).
    rope: Rope = dataclasses.field(default_factory=Rope)
    rope_local: Rope = dataclasses.field(default_factory=Rope)
    # q/k/v and gate/up are one fused linear each: qkv_proj, gate_up_proj (Phi-3).
    fused: bool = False
    # Queries per block of the attention: its scores take B * H * min(T, this) * T floats
    # (not the config.json's; a caller may replace it to trade memory for speed).
    attention_chunk: int = 128
    # Prefix of the decoder's tensor names ("model."; "language_model.model." for Gemma 3's
    # multimodal checkpoints).
    prefix: str = "model."
    # The sparse MLP block of a mixture of experts (moe_config.py); None for a dense model.
    moe: moe_config.Moe | None = None
    # Every decoder linear's input quantized and dequantized on the fly, as a serving stack runs
    # a scheme with dynamic input activations (W8A8, FP8_DYNAMIC; activations.py); None: float.
    input_quant: InputQuant | None = None


def from_hf_config(config: Mapping[str, Any]) -> LmConfig:
    """The LmConfig of a config.json dict; call it before any work.

    Raises:
        ValueError: the model_type is not in SUPPORTED (the message lists them), or the config
            asks for something this forward pass cannot do (an unknown rope type, bidirectional
            attention, an activation other than ACTIVATIONS, ...).
    """
    model_type = config.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    c, prefix = _text_config(model_type, config)
    heads = int(c["num_attention_heads"])
    head_dim = int(c.get("head_dim") or c["hidden_size"] // heads)
    layers = int(c["num_hidden_layers"])
    moe = moe_config.from_hf(c["model_type"], c, layers)
    arch = _DENSE_OF.get(c["model_type"], c["model_type"])
    if c["model_type"] == "qwen3_moe" and c.get("use_sliding_window"):
        raise ValueError("qwen3_moe: use_sliding_window is not supported")
    window, sliding = _sliding(arch, c, layers)
    rope, rope_local = rope_config.ropes(arch, c)
    gemma = arch in _GEMMA
    scalar = c.get("query_pre_attn_scalar") if arch in ("gemma2", "gemma3_text") else None
    # attention_bias: Llama, Qwen3 and Gemma give all four projections one; Qwen2's q/k/v always
    # have one; Mistral and Phi-3 have none.
    bias = bool(c.get("attention_bias", False)) and arch in ("llama", "qwen3", *_GEMMA)
    return LmConfig(
        model_type=model_type,
        hidden_size=int(c["hidden_size"]),
        intermediate_size=int(c["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(c["num_key_value_heads"]),
        head_dim=head_dim,
        vocab_size=int(c["vocab_size"]),
        rms_norm_eps=float(c["rms_norm_eps"]),
        activation=_activation(arch, c),
        tied=bool(c["tie_word_embeddings"]),
        qkv_bias=bias or (arch == "qwen2" and bool(c.get("qkv_bias", True))),
        o_bias=bias,
        mlp_bias=bool(c.get("mlp_bias", False)) and arch == "llama",
        qk_norm=arch in ("qwen3", "gemma3_text"),
        norm_plus_one=gemma,
        embed_scale=gemma,
        attn_softcap=_float_or_none(c.get("attn_logit_softcapping")) if gemma else None,
        final_softcap=_float_or_none(c.get("final_logit_softcapping")) if gemma else None,
        sandwich_norms=arch in ("gemma2", "gemma3_text"),
        sliding_window=window,
        sliding_layers=sliding,
        attn_scale=float(scalar if scalar is not None else head_dim) ** -0.5,
        rope=rope,
        rope_local=rope_local,
        fused=arch == "phi3",
        prefix=prefix,
        moe=moe,
    )


# Fields whose null in a config.json means "the default"; elsewhere null means "none" (a
# sliding_window or a soft-cap of null is no window, no cap, whatever the class's default).
_NONE_IS_UNSET = {
    "tie_word_embeddings",
    "rms_norm_eps",
    "head_dim",
    "hidden_act",
    "hidden_activation",
    "query_pre_attn_scalar",
    "max_window_layers",
    *_DEFAULTS["gemma3_text"],
} - {"sliding_window"}
_REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


def _text_config(model_type: str, config: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """The text model's fields over transformers' defaults, and its tensor names' prefix."""
    prefix = "model."
    if model_type == "gemma3":
        text = config.get("text_config")
        if not isinstance(text, Mapping):
            raise ValueError("gemma3 config.json has no text_config to read the text model from")
        if text.get("model_type", "gemma3_text") != "gemma3_text":
            raise ValueError(f"gemma3's text_config has model_type {text['model_type']!r}")
        # Its checkpoint names the text model language_model.model.* (what transformers 5 saves
        # too); the top level's tie_word_embeddings is the one its model class reads.
        tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings"))
        config = {**text, "model_type": "gemma3_text", "tie_word_embeddings": tie}
        prefix = "language_model.model."
    arch = config["model_type"]
    given = {k: v for k, v in config.items() if v is not None or k not in _NONE_IS_UNSET}
    c = {**_DEFAULTS[arch], **given}
    missing = [k for k in _REQUIRED if k not in c]
    if missing:
        raise ValueError(f"{model_type} config.json lacks {', '.join(missing)}")
    if c.get("num_key_value_heads") is None:
        c["num_key_value_heads"] = c["num_attention_heads"]
    if int(c["num_attention_heads"]) % int(c["num_key_value_heads"]):
        raise ValueError(
            f"{model_type}: {c['num_attention_heads']} attention heads do not share "
            f"{c['num_key_value_heads']} key/value heads evenly"
        )
    if c.get("use_bidirectional_attention"):
        raise ValueError(
            f"{model_type}: use_bidirectional_attention is not supported (causal only)"
        )
    return c, prefix


def _activation(arch: str, c: Mapping[str, Any]) -> str:
    """Gemma 2 and 3 read hidden_activation. Gemma 1's original GELU is the tanh approximation,
    which transformers 4 used whatever hidden_act said ("gelu" in the first Gemma configs)."""
    if arch in _GEMMA:
        act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
        act = "gelu_pytorch_tanh" if arch == "gemma" and act == "gelu" else act
    else:
        act = c.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"{arch}: activation {act!r} is not supported; supported: {ACTIVATIONS}")
    return act


def _sliding(arch: str, c: Mapping[str, Any], layers: int) -> tuple[int | None, tuple[bool, ...]]:
    """The sliding window and which layers use it, as transformers' config classes decide."""
    window = c.get("sliding_window")
    if arch in ("qwen2", "qwen3") and not c.get("use_sliding_window", False):
        window = None
    if arch in ("llama", "gemma") or window is None:
        return None, (False,) * layers
    types = c.get("layer_types")
    if arch in ("mistral", "phi3"):
        sliding = [True] * layers  # one window for every layer
    elif types is not None:
        if len(types) != layers:
            raise ValueError(f"{arch}: layer_types has {len(types)} entries for {layers} layers")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"{arch}: layer types {sorted(unknown)} are not supported")
        sliding = [t == "sliding_attention" for t in types]
    elif arch in ("qwen2", "qwen3"):
        sliding = [i >= int(c["max_window_layers"]) for i in range(layers)]
    elif arch == "gemma2":
        sliding = [i % 2 == 0 for i in range(layers)]
    else:  # gemma3_text: every sliding_window_pattern-th layer is global
        pattern = int(c.get("sliding_window_pattern", 6))
        sliding = [bool((i + 1) % pattern) for i in range(layers)]
    return int(window), tuple(sliding)


def layer_prefix(cfg: LmConfig, i: int) -> str:
    """The prefix of decoder layer i's tensor names ("model.layers.{i}.")."""
    if not 0 <= i < cfg.num_layers:
        raise ValueError(f"layer {i} out of range: the model has {cfg.num_layers} layers")
    return f"{cfg.prefix}layers.{i}."


def is_moe_layer(cfg: LmConfig, layer: int) -> bool:
    """Whether decoder layer `layer`'s MLP is the mixture-of-experts block."""
    return cfg.moe is not None and cfg.moe.layers[layer]


def _mlp_names(cfg: LmConfig, layer: int | None) -> tuple[str, ...] | None:
    """A mixture-of-experts layer's MLP linears; None for a dense MLP."""
    if cfg.moe is None:
        return None
    if layer is None:
        raise ValueError(f"{cfg.model_type}: the layers differ; name one")
    layer_prefix(cfg, layer)  # range check
    return moe_config.linear_names(cfg.moe) if cfg.moe.layers[layer] else None


def relative_linear_names(cfg: LmConfig, layer: int | None = None) -> tuple[str, ...]:
    """The linear weights of a decoder layer, relative to its prefix, in forward order (a
    mixture of experts' per expert: gate, up, down). `layer` is needed for a mixture of
    experts, whose layers may differ."""
    moe = _mlp_names(cfg, layer)
    if moe is not None:
        attn = tuple(f"self_attn.{n}_proj.weight" for n in "qkv")
        return (*attn, "self_attn.o_proj.weight", *moe)
    if cfg.fused:
        attn = ("self_attn.qkv_proj.weight",)
        mlp = ("mlp.gate_up_proj.weight",)
    else:
        attn = tuple(f"self_attn.{n}_proj.weight" for n in "qkv")
        mlp = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
    return (*attn, "self_attn.o_proj.weight", *mlp, "mlp.down_proj.weight")


def relative_tensor_names(cfg: LmConfig, layer: int | None = None) -> tuple[str, ...]:
    """Every tensor of a decoder layer, relative to its prefix."""
    names = list(relative_linear_names(cfg, layer))
    if cfg.moe is not None and cfg.moe.layers[layer]:  # layer checked by the line above
        names += moe_config.tensor_names(cfg.moe)[len(moe_config.linear_names(cfg.moe)) :]
    if cfg.qkv_bias:
        names += [f"self_attn.{n}_proj.bias" for n in "qkv"]
    if cfg.o_bias:
        names.append("self_attn.o_proj.bias")
    if cfg.mlp_bias:
        names += [f"mlp.{n}_proj.bias" for n in ("gate", "up", "down")]
    if cfg.qk_norm:
        names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    names += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    if cfg.sandwich_norms:
        names += ["pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"]
    return tuple(names)


def layer_tensor_names(cfg: LmConfig, i: int) -> tuple[str, ...]:
    """Every HF tensor name of decoder layer i (full names)."""
    prefix = layer_prefix(cfg, i)
    return tuple(prefix + n for n in relative_tensor_names(cfg, i))


def linear_names(cfg: LmConfig, i: int) -> tuple[str, ...]:
    """The full names of decoder layer i's linear weights: the quantization targets."""
    prefix = layer_prefix(cfg, i)
    return tuple(prefix + n for n in relative_linear_names(cfg, i))


def outer_tensor_names(cfg: LmConfig) -> dict[str, str | None]:
    """The tensors outside the decoder layers: "embed", "norm", and "head" (None when tied)."""
    head = (
        None
        if cfg.tied
        else ("language_model." if cfg.prefix != "model." else "") + ("lm_head.weight")
    )
    return {
        "embed": f"{cfg.prefix}embed_tokens.weight",
        "norm": f"{cfg.prefix}norm.weight",
        "head": head,
    }
