"""Batch jobs reserve their tensors' bytes under --max-inflight-bytes, as streams do.

The limiter (limits.ByteLimiter) lives on the server's event loop; a job runs in a thread. Room
bridges them: the job's thread asks the loop to reserve and waits in short slices, running the
job's cancellation check between them, so a cancelled (or stopping) job leaves the queue at once.
Every decision about a reservation -- granted, given up, granted just as it was given up -- is
taken on the loop thread, one after the other, so no byte is ever lost or counted twice.

A job waits its turn as long as it takes: a stream's client gets RESOURCE_EXHAUSTED after
--max-wait-seconds and retries; a job has no client to retry for it, so it queues again. Only a
tensor that could never fit fails the job.

ReservingBackend reserves room for each tensor before the pipeline reads it. Which tensor comes
next is known only once it is read, so it reserves the checkpoint's largest sendable tensor, and
gives back the difference once the read tells the size. The bytes stay counted until the tensor's
result has been written, then go back.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from qmill.checkpoints.formats import registry as formats
from qmill.checkpoints.run import plan
from qmill.server import errors, limits

# How often a job waiting for room runs its cancellation check.
_CHECK_SECONDS = 0.1


class Room:
    """The job thread's side of the server's ByteLimiter."""

    def __init__(self, limiter: limits.ByteLimiter, loop: asyncio.AbstractEventLoop) -> None:
        self._limiter = limiter
        self._loop = loop

    def reserve(self, tenant: str, n: int, check: Callable[[], None]) -> None:
        """Blocks until `n` bytes are counted for `tenant`; whatever `check` raises gives up.

        Raises:
            errors.ResourceExhausted: `n` is over the limit itself, so it can never fit.
        """
        limit = min(self._limiter.total, self._limiter.per_tenant)
        while True:
            try:
                return self._reserve_once(tenant, n, check)
            except errors.ResourceExhausted:
                if n > limit:
                    raise
                # Waited --max-wait-seconds without room: queue again (behind newer waiters).

    def _reserve_once(self, tenant: str, n: int, check: Callable[[], None]) -> None:
        done = threading.Event()
        state: dict[str, Any] = {}  # touched on the loop thread only

        def on_done(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is None and state.get("given_up"):
                self._limiter.release(tenant, n)  # granted as the job gave up: hand it on
            done.set()

        def start() -> None:
            task = self._loop.create_task(self._limiter.reserve(tenant, n))
            state["task"] = task
            task.add_done_callback(on_done)

        def give_up() -> None:
            state["given_up"] = True
            task = state["task"]
            if task.done():
                if not task.cancelled() and task.exception() is None:
                    self._limiter.release(tenant, n)
            else:
                task.cancel()  # the limiter takes it out of the queue (or hands its bytes on)

        self._call(start, check)
        while not done.wait(_CHECK_SECONDS):
            try:
                check()
            except BaseException:
                with contextlib.suppress(RuntimeError):  # the loop is gone, and its limiter
                    self._loop.call_soon_threadsafe(give_up)
                raise
        task = state["task"]
        if task.cancelled():  # the loop cancelled it: the server is stopping
            check()
            raise RuntimeError("the server stopped while the job waited for room")
        error = task.exception()
        if error is not None:
            raise error

    def _call(self, callback: Callable[[], None], check: Callable[[], None]) -> None:
        try:
            self._loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the event loop is closed: the server has stopped
            check()
            raise

    def release(self, tenant: str, n: int) -> None:
        if n:
            with contextlib.suppress(RuntimeError):  # a closed loop took its limiter along
                self._loop.call_soon_threadsafe(self._limiter.release, tenant, n)


class ReservingBackend:
    """A pipeline.Backend whose tensors are counted under the limiter while they are in memory."""

    def __init__(
        self,
        backend: Any,
        room: Room,
        *,
        tenant: str,
        largest: int,
        check: Callable[[], None],
    ) -> None:
        self._backend = backend
        self._room = room
        self._tenant = tenant
        self._largest = largest
        self._check = check

    def quantize(self, recipe: dict[str, Any], tensors: Any, **kwargs: Any) -> Iterator[Any]:
        held: dict[str, int] = {}
        reserving = [0]  # bytes reserved for a read in progress

        def counted() -> Iterator[Any]:
            source = iter(tensors)
            while True:
                self._room.reserve(self._tenant, self._largest, self._check)
                reserving[0] = self._largest
                try:
                    path, array = next(source)  # the pipeline reads the tensor here
                except StopIteration:
                    return
                nbytes = min(int(getattr(array, "nbytes", 0)), self._largest)
                self._give(self._largest - nbytes)
                reserving[0] = 0
                held[path] = held.get(path, 0) + nbytes
                yield path, array

        try:
            for outcome in self._backend.quantize(recipe, counted(), **kwargs):
                yield outcome
                # The pipeline has written this result before it asks for the next one.
                self._give(held.pop(outcome.path, 0))
        finally:
            self._give(sum(held.values()) + reserving[0])

    def _give(self, n: int) -> None:
        self._room.release(self._tenant, n)


def reserving(
    backend: Any, room: Room | None, *, tenant: str, source: str, check: Callable[[], None]
) -> Any:
    """`backend` with a job's tensors counted under the server's in-flight limit (no room: the
    backend as it is); the largest tensor it may be sent is reserved at the most."""
    if room is None:
        return backend
    with formats.open_source(source) as opened:
        sizes = [e.nbytes for e in opened.entries() if e.dtype.name in plan.QUANTIZABLE]
    largest = max(sizes, default=0)
    return ReservingBackend(backend, room, tenant=tenant, largest=largest, check=check)
