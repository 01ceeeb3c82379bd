"""Static-range statistics: additive running sums of calibrations, averaged on use.

A statistic is ``{"count": int32, "sum_of_<key>": fp32}`` for each key of a calibration
(``absmax``, or ``min`` and ``max``). Sums and counts add, so statistics from batches and workers
merge exactly; the calibration is ``sum / count``.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from qmill.engine import numerics

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
    """The averaging of the seeds' API: the mean of every calibration seen so far."""

    def init(self, calibration_: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        return init(calibration_)

    def update(
        self, stat: Mapping[str, jax.Array], calibration_: Mapping[str, jax.Array]
    ) -> dict[str, jax.Array]:
        return update(stat, calibration_)

    def get_calibration(self, stat: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        return calibration(stat)
