"""Hypothesis settings the fuzz tests share."""

from __future__ import annotations

from hypothesis import HealthCheck, settings


def derandomized(n: int, *suppressed: HealthCheck) -> settings:
    """`n` examples, derandomized (CI runs the same ones every time, and a failure reproduces),
    no deadline or example database; `suppressed`: health checks besides too_slow to skip."""
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, *suppressed],
    )
