"""Calibration: the range a block of values is quantized over, per docs/numerics-spec.md.

A calibration is a dict of arrays with the scale's shape: {"absmax"} for symmetric ranges,
{"min", "max"} for asymmetric ones. Methods are strings "<method>[,<args>]", case-insensitive:

  absmax[,f]              max |x| (times f)                     symmetric
  minmax[,f]              min clipped to <= 0, max to >= 0 (×f) asymmetric
  rms,f                   sqrt(mean(x²)) · f, used as absmax    symmetric
  fixed,lo,hi | fixed,m   one range for the whole tensor        symmetric iff lo == -hi
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from qmill.engine.core import numerics, tiling

# Method names, for GetCapabilities and error messages.
METHODS: tuple[str, ...] = ("absmax", "minmax", "rms", "fixed")


@dataclasses.dataclass(frozen=True)
class Method:
    """A parsed calibration method."""

    # One of METHODS.
    kind: str
    # Numeric arguments after the name, e.g. (0.9,) for "absmax,0.9" or (-2.0, 6.0) for fixed.
    args: tuple[float, ...] = ()

    @property
    def is_fixed(self) -> bool:
        return self.kind == "fixed"

    @property
    def fixed_range(self) -> tuple[float, float]:
        """(lo, hi) of a fixed method; "fixed,m" means (-m, m)."""
        return (-self.args[0], self.args[0]) if len(self.args) == 1 else self.args  # type: ignore[return-value]

    @property
    def symmetric(self) -> bool:
        if self.kind == "fixed":
            lo, hi = self.fixed_range
            return lo == -hi
        return self.kind != "minmax"


_ARITY = {"absmax": (0, 1), "minmax": (0, 1), "rms": (1,), "fixed": (1, 2)}


@functools.cache
def parse(method: str) -> Method:
    """Parses "<method>[,<args>]".

    Raises:
      ValueError: unknown method, wrong number of arguments, a non-number or non-finite
        argument, a factor that is not positive, or a fixed range that is empty or does not
        contain 0.
    """
    parts = [p.strip() for p in str(method).split(",")]
    kind = parts[0].lower()
    if kind not in _ARITY:
        raise ValueError(
            f"unknown calibration method {method!r}; valid: {', '.join(METHODS)} "
            "(as '<method>[,<args>]', e.g. 'absmax', 'rms,3', 'fixed,-6,6')"
        )
    try:
        args = tuple(float(a) for a in parts[1:])
    except ValueError:
        raise ValueError(f"calibration method {method!r}: arguments must be numbers") from None
    if len(args) not in _ARITY[kind]:
        want = " or ".join(str(n) for n in _ARITY[kind])
        raise ValueError(
            f"calibration method {method!r}: {kind} takes {want} argument(s), got {len(args)}"
        )
    # inf, nan and 1e400 (which parses as inf) made all-NaN scales; 0 and negative factors made
    # scale 1. Either is silent garbage in the output: refuse them here, at recipe load.
    if not all(math.isfinite(a) for a in args):
        raise ValueError(
            f"calibration method {method!r}: arguments must be finite numbers, got {list(args)}"
        )
    if kind != "fixed" and args and not args[0] > 0:
        raise ValueError(
            f"calibration method {method!r}: the factor scales the measured range and must be "
            f"positive (e.g. '{kind},0.9' clips to 90 %), got {args[0]}"
        )
    parsed = Method(kind, args)
    if kind == "fixed":
        lo, hi = parsed.fixed_range
        if not lo < hi or not lo <= 0 <= hi:
            raise ValueError(
                f"calibration method {method!r}: the fixed range [{lo}, {hi}] must be non-empty "
                "and contain 0"
            )
    return parsed


def _scaled(v: jax.Array, factor: float, dtype: jnp.dtype) -> jax.Array:
    return numerics.multiply_const(v, factor, dtype).astype(dtype)


def _rms(x: jax.Array, tiles: Sequence[int]) -> jax.Array:
    """sqrt(mean(x²)) per tile, each step rounded to x's dtype as op-by-op evaluation would."""
    square = numerics.fit(numerics.widen(x) ** 2, x.dtype)
    total = tiling.reduce_tiles(square, tiles, numerics.sum_as_cpu)
    count = x.size // total.size
    mean = numerics.fit(numerics.divide_broadcast(total, float(count), jnp.float32), x.dtype)
    return numerics.fit(numerics.sqrt(mean), x.dtype)


def calibrate(x: jax.Array, method: str | Method, tiles: Sequence[int]) -> dict[str, jax.Array]:
    """The calibration of `x` per block of `tiles` (see tiling.resolve_tiles).

    Returns:
      {"absmax": a} or {"min": lo, "max": hi}, in x's dtype, with the scale's shape — except
      fixed ranges, which are one per tensor (shape (1,) * ndim).
    """
    m = parse(method) if isinstance(method, str) else method
    if m.kind == "fixed":
        lo, hi = m.fixed_range
        shape = (1,) * x.ndim
        if m.symmetric:
            return {"absmax": jnp.full(shape, hi, x.dtype)}
        return {"min": jnp.full(shape, lo, x.dtype), "max": jnp.full(shape, hi, x.dtype)}
    if m.kind == "minmax":
        lo = jnp.minimum(tiling.reduce_tiles(x, tiles, jnp.min), 0)
        hi = jnp.maximum(tiling.reduce_tiles(x, tiles, jnp.max), 0)
        if m.args:
            lo, hi = _scaled(lo, m.args[0], x.dtype), _scaled(hi, m.args[0], x.dtype)
        return {"min": lo, "max": hi}
    if m.kind == "rms":
        return {"absmax": _scaled(_rms(x, tiles), m.args[0], x.dtype)}
    absmax = tiling.max_abs_tiles(x, tiles, numerics.widen).astype(x.dtype)
    if m.args:
        absmax = _scaled(absmax, m.args[0], x.dtype)
    return {"absmax": absmax}
