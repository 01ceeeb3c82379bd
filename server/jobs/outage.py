"""The job database away, as one runner sees it: one warning when it stops answering, one line
when it answers again, and a growing pause between tries of what can wait (progress) meanwhile.

A runner used to try a fresh connection and log a warning for every tensor a job finished while
the database was down: 4,469 lines in 8 s in a drill (issue 39). Progress that could not be
written is not lost: the runner keeps the latest of each field and writes it with the next try,
or with the job's final state (runner.py).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# The first pause after a failed try, and the longest; each next pause is twice the last.
FIRST_PAUSE_SECONDS = 0.5
MAX_PAUSE_SECONDS = 10.0


class Outage:
    """Whether the job database is away, since when, and when to try it again. Thread-safe: the
    runner's thread, its job's thread and the lease renewals share one."""

    def __init__(
        self,
        *,
        first_pause: float = FIRST_PAUSE_SECONDS,
        max_pause: float = MAX_PAUSE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._first, self._max, self._clock = first_pause, max_pause, clock
        self._lock = threading.Lock()
        self._since: float | None = None  # time.time() of the first failure, while away
        self._started = 0.0  # the same on `clock`
        self._pause = 0.0
        self._next_try = 0.0
        self._held = 0  # writes that waited for the database during this outage
        self._back = -math.inf  # `clock` when the last outage ended

    @property
    def away(self) -> bool:
        return self._since is not None

    def may_try(self) -> bool:
        """True unless the database is away and its next try is not due yet."""
        with self._lock:
            return self._since is None or self._clock() >= self._next_try

    def seconds_to_next_try(self) -> float:
        with self._lock:
            return 0.0 if self._since is None else max(0.0, self._next_try - self._clock())

    def answered_for(self, seconds: float) -> bool:
        """True when the database has answered for `seconds` since the last outage (or there
        was none); False while it is away."""
        with self._lock:
            return self._since is None and self._clock() - self._back >= seconds

    def held(self) -> None:
        """A write that waits for the database (not tried now: its next try is not due)."""
        with self._lock:
            self._held += 1

    def failed(self, error: BaseException, *, held: bool = True) -> None:
        """A try failed: the first of an outage logs one warning; each next one that was due
        doubles the pause (one made before, not held back, moves the next try no later)."""
        with self._lock:
            self._held += held
            if self._since is None:
                self._since, self._started = time.time(), self._clock()
                self._pause = self._first
                since = time.strftime("%H:%M:%S", time.gmtime(self._since))
                log.warning(
                    "jobs: the job database is unreachable since %s UTC (%s); progress is held "
                    "and written when it answers (tried again after %g s, then up to every %g s)",
                    since, error, self._first, self._max,
                )  # fmt: skip
            elif self._clock() >= self._next_try:
                self._pause = min(self._pause * 2, self._max)
            else:
                return  # a try not held back (a lease renewal): the next one stays as planned
            self._next_try = self._clock() + self._pause

    def answered(self) -> None:
        """A try succeeded: the end of an outage logs one line."""
        with self._lock:
            if self._since is None:
                return
            self._back = self._clock()
            seconds, held = self._back - self._started, self._held
            self._since, self._held = None, 0
        log.info(
            "jobs: the job database answers again after %.1f s; %d progress updates were "
            "pending, the latest of each job is written",
            seconds, held,
        )  # fmt: skip
