"""qmill.engine: the quantization engine (pure JAX; no files, network or gRPC).

The code lives in rooms (docs/architecture.md): core, modeling, ops, providers, contrib, and
qmill's own modelfree, programs and lm. This module is the seed-compatible public surface: the
reference's names, and its public modules as attributes (`from qmill.engine import qarray`)
wherever they live.

Importing it imports nothing else: each name imports its module on first use (PEP 562), so a
caller that needs one room (the model-free path of `qmill quantize`: modelfree and core) does
not pay for the others (the providers pull in flax.nnx, optax and treescope).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qmill.engine import contrib as contrib
    from qmill.engine.core import averaging as averaging
    from qmill.engine.core import calibration as calibration
    from qmill.engine.core import numerics as numerics
    from qmill.engine.core import qarray as qarray
    from qmill.engine.core import qtypes as qtypes
    from qmill.engine.core import sparsity as sparsity
    from qmill.engine.core import tiling as tiling
    from qmill.engine.core.averaging import SimpleMovingAverage as SimpleMovingAverage
    from qmill.engine.core.qarray import HowToQuantize as HowToQuantize
    from qmill.engine.core.qarray import QArray as QArray
    from qmill.engine.core.qarray import dequantize as dequantize
    from qmill.engine.core.qarray import quantize_api as quantize  # noqa: F401 (in _PUBLIC)
    from qmill.engine.modeling import flax_util as flax_util
    from qmill.engine.modeling import interception as interception
    from qmill.engine.modeling.flax_util import QuantStat as QuantStat
    from qmill.engine.modeling.rules import LoraRule as LoraRule
    from qmill.engine.modeling.rules import QtRule as QtRule
    from qmill.engine.modeling.rules import QuantizationRule as QuantizationRule
    from qmill.engine.ops.conv_general import conv_general_dilated as conv_general_dilated
    from qmill.engine.ops.dot import dot as dot
    from qmill.engine.ops.dot_general import dot_general as dot_general
    from qmill.engine.ops.einsum import einsum as einsum
    from qmill.engine.ops.ragged_dot import ragged_dot as ragged_dot
    from qmill.engine.ops.ragged_dot import ragged_dot_general as ragged_dot_general
    from qmill.engine.programs import zoo as zoo
    from qmill.engine.providers import checkpoint_utils as checkpoint_utils
    from qmill.engine.providers import model as model
    from qmill.engine.providers import qconfig as qconfig
    from qmill.engine.providers.base import QuantizationProvider as QuantizationProvider
    from qmill.engine.providers.checkpoint_utils import (
        process_prequantized_params as process_prequantized_params,
    )
    from qmill.engine.providers.checkpoint_utils import (
        restore_quantization_rules as restore_quantization_rules,
    )
    from qmill.engine.providers.lora import LoRAParam as LoRAParam
    from qmill.engine.providers.lora import LoraProvider as LoraProvider
    from qmill.engine.providers.lora import apply_lora_to_model as apply_lora_to_model
    from qmill.engine.providers.model import quantize_model as quantize_model
    from qmill.engine.providers.odml import OdmlQatProvider as OdmlQatProvider
    from qmill.engine.providers.odml_conversion import (
        OdmlConversionProvider as OdmlConversionProvider,
    )
    from qmill.engine.providers.ptq import PtqProvider as PtqProvider
    from qmill.engine.providers.ptq import WithAux as WithAux
    from qmill.engine.providers.ptq import quantize_params as quantize_params
    from qmill.engine.providers.qt import QtProvider as QtProvider

# Each public name: (the module it comes from, its attribute there; None: the module itself).
_PUBLIC: dict[str, tuple[str, str | None]] = {
    "contrib": ("qmill.engine.contrib", None),
    "averaging": ("qmill.engine.core.averaging", None),
    "calibration": ("qmill.engine.core.calibration", None),
    "numerics": ("qmill.engine.core.numerics", None),
    "qarray": ("qmill.engine.core.qarray", None),
    "qtypes": ("qmill.engine.core.qtypes", None),
    "sparsity": ("qmill.engine.core.sparsity", None),
    "tiling": ("qmill.engine.core.tiling", None),
    "SimpleMovingAverage": ("qmill.engine.core.averaging", "SimpleMovingAverage"),
    "HowToQuantize": ("qmill.engine.core.qarray", "HowToQuantize"),
    "QArray": ("qmill.engine.core.qarray", "QArray"),
    "dequantize": ("qmill.engine.core.qarray", "dequantize"),
    "quantize": ("qmill.engine.core.qarray", "quantize_api"),
    "flax_util": ("qmill.engine.modeling.flax_util", None),
    "interception": ("qmill.engine.modeling.interception", None),
    "QuantStat": ("qmill.engine.modeling.flax_util", "QuantStat"),
    "LoraRule": ("qmill.engine.modeling.rules", "LoraRule"),
    "QtRule": ("qmill.engine.modeling.rules", "QtRule"),
    "QuantizationRule": ("qmill.engine.modeling.rules", "QuantizationRule"),
    "conv_general_dilated": ("qmill.engine.ops.conv_general", "conv_general_dilated"),
    "dot": ("qmill.engine.ops.dot", "dot"),
    "dot_general": ("qmill.engine.ops.dot_general", "dot_general"),
    "einsum": ("qmill.engine.ops.einsum", "einsum"),
    "ragged_dot": ("qmill.engine.ops.ragged_dot", "ragged_dot"),
    "ragged_dot_general": ("qmill.engine.ops.ragged_dot", "ragged_dot_general"),
    "zoo": ("qmill.engine.programs.zoo", None),
    "checkpoint_utils": ("qmill.engine.providers.checkpoint_utils", None),
    "qconfig": ("qmill.engine.providers.qconfig", None),
    # The reference's model module (quantize_model, quantize_linen_model).
    "model": ("qmill.engine.providers.model", None),
    "QuantizationProvider": ("qmill.engine.providers.base", "QuantizationProvider"),
    "process_prequantized_params": (
        "qmill.engine.providers.checkpoint_utils",
        "process_prequantized_params",
    ),
    "restore_quantization_rules": (
        "qmill.engine.providers.checkpoint_utils",
        "restore_quantization_rules",
    ),
    "LoRAParam": ("qmill.engine.providers.lora", "LoRAParam"),
    "LoraProvider": ("qmill.engine.providers.lora", "LoraProvider"),
    "apply_lora_to_model": ("qmill.engine.providers.lora", "apply_lora_to_model"),
    "quantize_model": ("qmill.engine.providers.model", "quantize_model"),
    "OdmlConversionProvider": ("qmill.engine.providers.odml_conversion", "OdmlConversionProvider"),
    "OdmlQatProvider": ("qmill.engine.providers.odml", "OdmlQatProvider"),
    "PtqProvider": ("qmill.engine.providers.ptq", "PtqProvider"),
    "WithAux": ("qmill.engine.providers.ptq", "WithAux"),
    "quantize_params": ("qmill.engine.providers.ptq", "quantize_params"),
    "QtProvider": ("qmill.engine.providers.qt", "QtProvider"),
}

__all__ = sorted(_PUBLIC)


# The rooms, attributes once imported (as every one was when this module imported them all).
_ROOMS = ("contrib", "core", "lm", "modelfree", "modeling", "ops", "programs", "providers")


def __getattr__(name: str) -> Any:
    """A public name or a room, imported on first use and kept (PEP 562)."""
    if name in _ROOMS:
        return importlib.import_module(f"{__name__}.{name}")
    try:
        module, attribute = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = importlib.import_module(module)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_ROOMS))
