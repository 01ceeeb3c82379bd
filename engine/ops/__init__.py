"""Quantized ops: dot_general, einsum, dot, conv_general_dilated, ragged_dot taking QArrays or
arrays; mxfp_dot multiplies block-scaled formats. The *_qt modules add quantized backward passes
for QT, and op_adapter turns a rule into the HowToQuantize each side of an op needs. Built on
engine.core and engine.modeling; the providers call these."""

from qmill.engine.ops import conv_general as conv_general
from qmill.engine.ops import dot as dot
from qmill.engine.ops import dot_general as dot_general
from qmill.engine.ops import einsum as einsum
from qmill.engine.ops import mxfp_dot as mxfp_dot
from qmill.engine.ops import ragged_dot as ragged_dot
from qmill.engine.ops import ragged_dot_qt as ragged_dot_qt

__all__ = [
    "conv_general",
    "dot",
    "dot_general",
    "einsum",
    "mxfp_dot",
    "ragged_dot",
    "ragged_dot_qt",
]
