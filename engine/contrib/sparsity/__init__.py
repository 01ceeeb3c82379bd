"""N:M structured sparsity for quantized training as state of an NNX model (the reference's
qwix.contrib.sparsity)."""

from qmill.engine.contrib.sparsity import sparsity_module as sparsity_module

__all__ = ["sparsity_module"]
