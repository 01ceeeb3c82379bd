"""The providers' single door to the quantized ops of ``qmill.engine.ops``.

Keyword-only wrappers, so the providers call every op and its how-to-quantize the same way.
"""

from __future__ import annotations

import jax

from qmill.engine import ops, qarray


def dot_general_how(
    *, dimension_numbers, ndims, for_lhs, qtype, tile_size, calibration_method
) -> qarray.HowToQuantize:
    return ops.dot_general.get_how_to_quantize(
        dimension_numbers=dimension_numbers,
        ndims=ndims,
        for_lhs=for_lhs,
        qtype=qtype,
        tile_size=tile_size,
        calibration_method=calibration_method,
    )


def einsum_how(
    *, einsum_str, ndims, for_lhs, qtype, tile_size, calibration_method
) -> qarray.HowToQuantize:
    return ops.einsum.get_how_to_quantize(
        einsum_str=einsum_str,
        ndims=ndims,
        for_lhs=for_lhs,
        qtype=qtype,
        tile_size=tile_size,
        calibration_method=calibration_method,
    )


def conv_how(*, dimension_numbers, for_lhs, qtype, calibration_method) -> qarray.HowToQuantize:
    return ops.conv_general.get_how_to_quantize(
        dimension_numbers=dimension_numbers,
        for_lhs=for_lhs,
        qtype=qtype,
        calibration_method=calibration_method,
    )


def dot_general(lhs, rhs, dimension_numbers, **kwargs) -> jax.Array:
    return ops.dot_general.dot_general(lhs, rhs, dimension_numbers, **kwargs)


def einsum(einsum_str, lhs, rhs, **kwargs) -> jax.Array:
    return ops.einsum.einsum(einsum_str, lhs, rhs, **kwargs)


def conv_general_dilated(lhs, rhs, *args, **kwargs) -> jax.Array:
    return ops.conv_general.conv_general_dilated(lhs, rhs, *args, **kwargs)
