"""Quantized ops: dot_general, einsum, dot, conv_general_dilated taking QArrays or arrays."""

from qmill.engine.ops import conv_general as conv_general
from qmill.engine.ops import dot as dot
from qmill.engine.ops import dot_general as dot_general
from qmill.engine.ops import einsum as einsum

__all__ = ["conv_general", "dot", "dot_general", "einsum"]
