"""Retrying a call while the server is UNAVAILABLE or busy, with bounded exponential backoff.

Retried: UNAVAILABLE (the server is down, restarting or unreachable) and RESOURCE_EXHAUSTED that
carries the server's retry hint (its in-flight room or stream slots are taken for now; waiting
at least as long as it asks). A resumable job (pipeline.quantize_checkpoint) loses nothing by
being called again. Every other error, a limit that can never be met included (no hint), is the
caller's to fix and is raised at once.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from qmill.client import errors

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Backoff:
    # Retries after the first attempt; 0 disables retrying.
    retries: int = 6
    # Seconds before the first retry; each next wait is `factor` times longer.
    initial_seconds: float = 1.0
    factor: float = 2.0
    # No single wait is longer than this.
    max_seconds: float = 30.0

    def delays(self) -> list[float]:
        return [
            min(self.max_seconds, self.initial_seconds * self.factor**i)
            for i in range(self.retries)
        ]


def call(
    attempt: Callable[[], T],
    backoff: Backoff,
    *,
    on_retry: Callable[[str], None],
    retry_if: Callable[[errors.QmillError], bool] = lambda e: True,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Calls `attempt()` until it does not fail with a retryable error or the retries are spent.

    Args:
        attempt: the whole call, opening its own connection (a channel to a dead server may
            wait out gRPC's own reconnect backoff; a fresh one tries at once).
        backoff: how many retries, and how long to wait before each.
        on_retry: told one line per retry (what failed, how long until the next try).
        retry_if: whether an UNAVAILABLE is worth retrying (the CLI fails at once on a server
            it never reached: more likely a wrong address than a restart). A server that
            refused with a retry hint was reached: that is always retried.
        sleep: the wait; tests pass a fake.

    Raises:
        errors.QmillError: the last retryable error once retries are spent, or any other.
    """
    delays = backoff.delays()
    for number, delay in enumerate([*delays, None], start=1):
        try:
            return attempt()
        except errors.QmillError as e:
            busy = e.code == "RESOURCE_EXHAUSTED" and e.retry_after is not None
            unavailable = e.code == "UNAVAILABLE" and retry_if(e)
            if delay is None or not (busy or unavailable):
                raise
            if busy:
                delay = max(delay, e.retry_after or 0.0)
            reason = e.details.splitlines()[0] if e.details else "no details"
            what = "server busy" if busy else "server unavailable"
            on_retry(f"{what} ({reason}); retry {number}/{len(delays)} in {delay:.1f} s")
            sleep(delay)
    raise AssertionError("unreachable")  # the loop returns or raises


class NoticeAnswers:
    """A pipeline.Backend that sets `answered` once the server behind it has returned a tensor."""

    def __init__(self, backend: Any, answered: threading.Event) -> None:
        self._backend = backend
        self._answered = answered

    def quantize(self, recipe: dict[str, Any], tensors: Any, **kwargs: Any) -> Iterator[Any]:
        for outcome in self._backend.quantize(recipe, tensors, **kwargs):
            self._answered.set()
            yield outcome
