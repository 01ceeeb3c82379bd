"""The providers' single door to the quantized ops of ``qmill.engine.ops``.

TODO(engine core): until ``qmill.engine.ops`` lands, the fallbacks below compute with dequantized
operands and pick channelwise / tiled axes with a minimal rule (non-contracting axes are channels,
contracting axes are tiled). They exist only so the providers can be tested meanwhile; once the
ops module is importable it is used instead and the fallbacks can be deleted.
"""

from __future__ import annotations

import importlib
from typing import Any

import jax

from qmill.engine import qarray


def _ops() -> Any:
    try:
        return importlib.import_module("qmill.engine.ops")
    except ImportError:
        return None


def _deq(x: Any) -> Any:
    return qarray.dequantize(x) if isinstance(x, qarray.QArray) else x


def _how(ndim, channels, contracting, qtype, tile_size, calibration_method) -> Any:
    tiled = {a: tile_size for a in contracting} if tile_size else {}
    return qarray.HowToQuantize(
        qtype=qtype,
        channelwise_axes=tuple(a for a in range(ndim) if a in channels),
        tiled_axes=tiled,
        calibration_method=calibration_method,
    )


def dot_general_how(
    *, dimension_numbers, ndims, for_lhs, qtype, tile_size, calibration_method
) -> qarray.HowToQuantize:
    ops = _ops()
    if ops is not None:
        return ops.dot_general.get_how_to_quantize(
            dimension_numbers=dimension_numbers,
            ndims=ndims,
            for_lhs=for_lhs,
            qtype=qtype,
            tile_size=tile_size,
            calibration_method=calibration_method,
        )
    (lc, rc), _ = dimension_numbers
    side = 0 if for_lhs else 1
    contracting = tuple(lc if for_lhs else rc)
    channels = [a for a in range(ndims[side]) if a not in contracting]
    return _how(ndims[side], channels, contracting, qtype, tile_size, calibration_method)


def einsum_how(
    *, einsum_str, ndims, for_lhs, qtype, tile_size, calibration_method
) -> qarray.HowToQuantize:
    ops = _ops()
    if ops is not None:
        return ops.einsum.get_how_to_quantize(
            einsum_str=einsum_str,
            ndims=ndims,
            for_lhs=for_lhs,
            qtype=qtype,
            tile_size=tile_size,
            calibration_method=calibration_method,
        )
    inputs, out = einsum_str.replace(" ", "").split("->")
    lhs, rhs = inputs.split(",")
    mine, other = (lhs, rhs) if for_lhs else (rhs, lhs)
    channels = [i for i, c in enumerate(mine) if c in out]
    contracting = tuple(i for i, c in enumerate(mine) if c in other and c not in out)
    return _how(len(mine), channels, contracting, qtype, tile_size, calibration_method)


def conv_how(*, dimension_numbers, for_lhs, qtype, calibration_method) -> qarray.HowToQuantize:
    ops = _ops()
    if ops is not None:
        return ops.conv_general.get_how_to_quantize(
            dimension_numbers=dimension_numbers,
            for_lhs=for_lhs,
            qtype=qtype,
            calibration_method=calibration_method,
        )
    spec = dimension_numbers.lhs_spec if for_lhs else dimension_numbers.rhs_spec
    channel = spec[0]  # lhs: batch axis; rhs: output feature axis
    return _how(len(spec), [channel], (), qtype, None, calibration_method)


def dot_general(lhs, rhs, dimension_numbers, **kwargs) -> jax.Array:
    ops = _ops()
    if ops is not None:
        return ops.dot_general.dot_general(lhs, rhs, dimension_numbers, **kwargs)
    return jax.lax.dot_general(_deq(lhs), _deq(rhs), dimension_numbers, **kwargs)


def einsum(einsum_str, lhs, rhs, **kwargs) -> jax.Array:
    ops = _ops()
    if ops is not None:
        return ops.einsum.einsum(einsum_str, lhs, rhs, **kwargs)
    return jax.numpy.einsum(einsum_str, _deq(lhs), _deq(rhs), **kwargs)


def conv_general_dilated(lhs, rhs, *args, **kwargs) -> jax.Array:
    ops = _ops()
    if ops is not None:
        return ops.conv_general.conv_general_dilated(lhs, rhs, *args, **kwargs)
    return jax.lax.conv_general_dilated(_deq(lhs), _deq(rhs), *args, **kwargs)
