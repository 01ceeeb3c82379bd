"""Static-range statistics: additive running sums of calibrations, averaged on use.

A statistic is ``{"count": int32, "sum_of_<key>": fp32}`` for each key of a calibration
(``absmax``, or ``min`` and ``max``). Sums and counts add, so statistics from batches and workers
merge exactly; the calibration is ``sum / count``.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from qmill.engine.core import numerics

_PREFIX = "sum_of_"


def init(calibration: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """An empty statistic shaped like ``calibration``."""
    stat = {"count": jnp.zeros((), jnp.int32)}
    for key, value in calibration.items():
        stat[_PREFIX + key] = jnp.zeros(jnp.shape(value), jnp.float32)
    return stat


def update(
    stat: Mapping[str, jax.Array], calibration: Mapping[str, jax.Array]
) -> dict[str, jax.Array]:
    """Adds one calibration to the statistic."""
    new = {"count": stat["count"] + 1}
    for key, value in calibration.items():
        new[_PREFIX + key] = stat[_PREFIX + key] + value.astype(jnp.float32)
    return new


def merge(a: Mapping[str, jax.Array], b: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """The statistic of the union of two sets of batches."""
    return {key: a[key] + b[key] for key in a}


def calibration(stat: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """The averaged calibration; a statistic with count 0 averages to zeros."""
    count = jnp.maximum(stat["count"], 1).astype(jnp.float32)
    return {
        key.removeprefix(_PREFIX): numerics.divide_broadcast(value, count, jnp.float32)
        for key, value in stat.items()
        if key.startswith(_PREFIX)
    }


class SimpleMovingAverage:
    """The averaging of the seeds' API: the mean of every calibration seen so far.

    ``bootstrap_steps``: while a statistic has seen at most this many calibrations,
    ``get_calibration`` returns the ``default_calibration`` it is given (typically the current
    batch's own), so early, noisy averages are not used.
    """

    def __init__(self, bootstrap_steps: int = 0) -> None:
        if int(bootstrap_steps) != bootstrap_steps or bootstrap_steps < 0:
            raise ValueError(f"bootstrap_steps must be a non-negative int, got {bootstrap_steps!r}")
        self.bootstrap_steps = int(bootstrap_steps)

    def init(self, calibration_: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        return init(calibration_)

    def update(
        self, stat: Mapping[str, jax.Array], calibration_: Mapping[str, jax.Array]
    ) -> dict[str, jax.Array]:
        """Adds one calibration.

        Raises:
          ValueError: a calibration whose shapes differ from the statistic's (silently
            broadcasting them would hide a configuration error).
        """
        for key, value in calibration_.items():
            have = jnp.shape(stat[_PREFIX + key])
            if have != jnp.shape(value):
                raise ValueError(
                    f"calibration {key!r} has shape {jnp.shape(value)} but the statistic holds "
                    f"{have}; were the stats collected with another tiling or batch layout?"
                )
        return update(stat, calibration_)

    def get_calibration(
        self,
        stat: Mapping[str, jax.Array],
        default_calibration: Mapping[str, jax.Array] | None = None,
    ) -> dict[str, jax.Array]:
        """The averaged calibration, or ``default_calibration`` (when given) while the count is
        at most ``bootstrap_steps``; the average then takes the default's dtypes."""
        averaged = calibration(stat)
        if default_calibration is None:
            return averaged
        default = dict(default_calibration)
        if set(default) != set(averaged):
            raise ValueError(
                f"default_calibration has keys {sorted(default)} but the statistic averages "
                f"{sorted(averaged)}; pass a calibration of the same method"
            )
        averaged = {k: v.astype(jnp.asarray(default[k]).dtype) for k, v in averaged.items()}
        return jax.lax.cond(stat["count"] > self.bootstrap_steps, lambda: averaged, lambda: default)
