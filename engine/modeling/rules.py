"""Quantization rules: which ops of which modules get quantized, and how.

A rule is matched against the '/'-joined path of the Flax module running an op (``"encoder/
layers_0/attn"``; the top module is ``""``) and the op's name (``"dot_general"``, also for
``jnp.dot`` and ``@``; ``"einsum"``, ``"conv_general_dilated"``, ``"ragged_dot"``). The regex must
match the whole path, and the first matching rule in the list wins, so specific rules go before
catch-all ones.

These are model-level rules; the service-level presets in ``recipes.py`` are a different concept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax

from qmill.engine.core import qarray_util, sparsity
from qmill.engine.modeling import linear_regex

QType = Any  # a qtype name ("int8", "nf4", ...) or a dtype (jnp.int8, jnp.float8_e4m3fn, ...).

_STOCHASTIC_ROUNDING_MODES = ("uniform", "low_bit_uniform")


def _as_tuple(value: Collection[Any], field_name: str) -> tuple[Any, ...]:
    # A bare string is a collection of characters; taking it as one would silently match nothing.
    if isinstance(value, str):
        raise TypeError(f"{field_name} must be a collection, not the string {value!r}; wrap it.")
    return tuple(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizationRule:
    """Matches ops in modules and says how to quantize their weights and activations."""

    # Regex that must fully match the '/'-joined module path; '.*' matches every module.
    module_path: str = ".*"
    # Op names the rule applies to; empty means every intercepted op.
    op_names: Collection[str] = ()
    # Qtype of weights; None leaves the op unquantized (activations too).
    weight_qtype: QType | None = None
    # Qtype of activations; None quantizes weights only.
    act_qtype: QType | None = None
    # Tile size along contracting axes (subchannel quantization); a float is 1 / tile count. A
    # mapping {axis: tile} tiles exactly those axes of each operand.
    tile_size: int | float | Mapping[int, int | float] | None = None
    # Activations use a static scale computed from calibration statistics; None means False.
    act_static_scale: bool | None = None
    # Calibration of weights, "<method>[,<args>]" as in docs/numerics-spec.md.
    weight_calibration_method: str = "absmax"
    # Calibration of activations; None means "absmax".
    act_calibration_method: str | None = None
    # Axes of activations that static statistics are averaged over (the batch axes).
    act_batch_axes: Collection[int] = (0,)
    # N:M sparsity of weights (sparsity.SparsityRule), applied by QT before quantizing them.
    sparsity_rule: sparsity.SparsityRule | None = None

    def __post_init__(self) -> None:
        compile_module_path(self.module_path)  # refuses a bad regex now, not at the first op
        # Normalised to tuples so that rules stay hashable and comparable.
        object.__setattr__(self, "op_names", _as_tuple(self.op_names, "op_names"))
        object.__setattr__(self, "act_batch_axes", _as_tuple(self.act_batch_axes, "act_batch_axes"))
        if self.act_qtype is not None and self.weight_qtype is None:
            raise ValueError(
                f"act_qtype={self.act_qtype!r} needs a weight_qtype: ops whose weights are not "
                "quantized are left unquantized. Set weight_qtype too."
            )
        if self.act_static_scale and self.act_qtype is None:
            raise ValueError(
                "act_static_scale is set to True but act_qtype is None; set act_qtype or drop "
                "act_static_scale."
            )
        if self.act_calibration_method is not None and self.act_qtype is None:
            raise ValueError("act_calibration_method is set but act_qtype is None; set act_qtype.")
        if isinstance(self.tile_size, Mapping):
            # {axis: tile} tiles those axes of every operand, as the reference; kept as a
            # hashable AxisTiles (reads as the mapping) so that rules and the HowToQuantize built
            # from them stay usable as static jit arguments.
            tiles = qarray_util.AxisTiles(sorted((int(a), t) for a, t in self.tile_size.items()))
            object.__setattr__(self, "tile_size", tiles)
        tiles = self.tile_size if isinstance(self.tile_size, tuple) else [(None, self.tile_size)]
        for _, tile in tiles:
            if tile is not None and not tile > 0:
                raise ValueError(f"tile_size must be positive, got {self.tile_size!r}.")

    def matches(self, module_path: str, op_name: str) -> bool:
        """Whether this rule applies to ``op_name`` running in the module at ``module_path``."""
        if self.op_names and op_name not in self.op_names:
            return False
        return compile_module_path(self.module_path).fullmatch(module_path) is not None

    @property
    def resolved_act_static_scale(self) -> bool:
        return bool(self.act_static_scale)

    @property
    def resolved_act_calibration_method(self) -> str:
        return self.act_calibration_method or "absmax"


@dataclasses.dataclass(frozen=True, kw_only=True)
class QtRule(QuantizationRule):
    """A QuantizationRule with the settings specific to quantized training (QT)."""

    # Qtype of gradients in the backward pass; None keeps gradients in floating point.
    bwd_qtype: QType | None = None
    # Calibration of gradients.
    bwd_calibration_method: str = "absmax"
    # Tile size along the (last) axis the weight gradient contracts, i.e. the batch axis of a
    # dense layer, when the gradient is quantized for it; None is one scale along that axis.
    bwd_weight_grad_tile_size: int | float | None = None
    # Quantize every operand per tensor instead of per channel.
    disable_channelwise_axes: bool = False
    # Stochastic rounding of gradients: None, "uniform" or "low_bit_uniform".
    bwd_stochastic_rounding: str | None = None
    # Axes along which stochastic-rounding noise varies; it is broadcast over the other axes.
    channelwise_noise_axes: Sequence[int] = (0,)
    # Free-form settings for experimental QT features; unused keys are ignored.
    additional_qt_config: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(
            self,
            "channelwise_noise_axes",
            _as_tuple(self.channelwise_noise_axes, "channelwise_noise_axes"),
        )
        if self.bwd_stochastic_rounding not in (None, *_STOCHASTIC_ROUNDING_MODES):
            raise ValueError(
                f"bwd_stochastic_rounding={self.bwd_stochastic_rounding!r}; expected None or one "
                f"of {_STOCHASTIC_ROUNDING_MODES}."
            )
        if self.bwd_qtype is None and (
            self.bwd_stochastic_rounding is not None or self.bwd_weight_grad_tile_size is not None
        ):
            raise ValueError(
                "bwd_stochastic_rounding / bwd_weight_grad_tile_size need bwd_qtype; set it."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraRule(QuantizationRule):
    """Matches ops that get a low-rank adapter.

    The adapter is added whether or not weight_qtype is set; weight_qtype makes the frozen base
    weight quantized (QLoRA).
    """

    # Rank of the adapter (columns of lora_a, rows of lora_b).
    rank: int
    # The adapter's output is scaled by alpha / rank.
    alpha: float
    # Dropout rate on the adapter's input during training.
    dropout: float = 0.0
    # Initializer of lora_a (input side); random so that gradients reach lora_b.
    lora_a_initializer: Callable[..., jax.Array] = jax.nn.initializers.he_uniform()  # noqa: RUF009
    # Initializer of lora_b (output side); zeros so that the adapted model starts as the base.
    lora_b_initializer: Callable[..., jax.Array] = jax.nn.initializers.zeros

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (isinstance(self.rank, int) and self.rank > 0):
            raise ValueError(f"rank must be a positive int, got {self.rank!r}.")
        # As the reference (nnx.Dropout): 1.0 is allowed and drops the adapter's input entirely.
        if not 0.0 <= self.dropout <= 1.0:
            raise ValueError(f"dropout must be in [0, 1], got {self.dropout!r}.")


def compile_module_path(pattern: str) -> Any:
    """``pattern`` compiled for matching module paths in linear time (linear_regex)."""
    return linear_regex.compile(pattern, "module_path")


def find_rule(
    rules: Sequence[QuantizationRule], module_path: str, op_name: str
) -> tuple[int, QuantizationRule] | tuple[None, None]:
    """Returns (index, rule) of the first rule matching the op, or (None, None)."""
    for i, rule in enumerate(rules):
        if rule.matches(module_path, op_name):
            return i, rule
    return None, None
