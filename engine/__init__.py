"""qmill.engine: the quantization engine (pure JAX; no files, network or gRPC).

The code lives in rooms (docs/architecture.md): core, modeling, ops, providers, contrib, and
qmill's own modelfree and programs. This module is the seed-compatible public surface: the
reference's names, and its public modules as attributes (`from qmill.engine import qarray`)
wherever they live.
"""

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
from qmill.engine.core.qarray import quantize_api as quantize
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
from qmill.engine.providers.odml import OdmlConversionProvider as OdmlConversionProvider
from qmill.engine.providers.odml import OdmlQatProvider as OdmlQatProvider
from qmill.engine.providers.ptq import PtqProvider as PtqProvider
from qmill.engine.providers.ptq import WithAux as WithAux
from qmill.engine.providers.ptq import quantize_params as quantize_params
from qmill.engine.providers.qt import QtProvider as QtProvider

__all__ = [
    "HowToQuantize",
    "LoRAParam",
    "LoraProvider",
    "LoraRule",
    "OdmlConversionProvider",
    "OdmlQatProvider",
    "PtqProvider",
    "QArray",
    "QtProvider",
    "QtRule",
    "QuantStat",
    "QuantizationProvider",
    "QuantizationRule",
    "SimpleMovingAverage",
    "WithAux",
    "apply_lora_to_model",
    "averaging",
    "calibration",
    "checkpoint_utils",
    "contrib",
    "conv_general_dilated",
    "dequantize",
    "dot",
    "dot_general",
    "einsum",
    "flax_util",
    "interception",
    "numerics",
    "process_prequantized_params",
    "qarray",
    "qconfig",
    "qtypes",
    "quantize",
    "quantize_model",
    "quantize_params",
    "ragged_dot",
    "ragged_dot_general",
    "restore_quantization_rules",
    "sparsity",
    "tiling",
    "zoo",
]
