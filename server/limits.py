"""Backpressure: bytes in flight (server-wide and per tenant) and concurrent streams.

Tensor bytes are reserved before the buffer that receives them is allocated, so memory for
assembled tensors never exceeds `max_inflight_bytes` whatever the number of clients. A call that
finds no room waits (that is the backpressure: its client's sends stall) up to
`admission_timeout_seconds`, then gets RESOURCE_EXHAUSTED with a retry hint in the message and in
the `retry-delay-ms` trailing metadata. A request that could never fit fails at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from qmill.proto import wire
from qmill.server import auth, calls

log = logging.getLogger(__name__)

RETRY_TRAILER = "retry-delay-ms"
# Services whose streams do not count against max_concurrent_streams (health Watch is a probe).
_UNCOUNTED = auth.PUBLIC_PREFIXES


class Exhausted(wire.WireError):
    """A limit was hit; carries how long the client should wait before retrying."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(f"{message}; retry in {retry_after:g} s", code="RESOURCE_EXHAUSTED")
        self.retry_after = retry_after
        # Set here so the hint reaches the client whichever layer turns this into a status.
        calls.add_trailer(RETRY_TRAILER, str(round(retry_after * 1000)))


class ByteLimiter:
    """Counts reserved bytes, server-wide and per tenant, on one asyncio.Condition.

    Runs on the server's event loop only (reservations come from coroutines).
    """

    def __init__(
        self,
        total: int,
        per_tenant: int,
        *,
        wait_seconds: float,
        retry_after: float = 1.0,
        on_change: Callable[[int], None] | None = None,
    ) -> None:
        self.total = total
        self.per_tenant = per_tenant
        self.wait_seconds = wait_seconds
        self.retry_after = retry_after
        self.used = 0
        self.peak = 0
        self.waits = 0  # reservations that had to wait for room (a sign the limit was binding)
        self.by_tenant: dict[str, int] = {}
        self._on_change = on_change
        self._room = asyncio.Condition()
        self._wakers: set[asyncio.Task] = set()  # referenced until done (asyncio keeps weak refs)

    def _fits(self, tenant: str, n: int) -> bool:
        return self.used + n <= self.total and self.by_tenant.get(tenant, 0) + n <= self.per_tenant

    async def reserve(self, tenant: str, n: int) -> None:
        """Waits for room for `n` bytes; raises Exhausted when they never fit or time runs out."""
        limit = min(self.total, self.per_tenant)
        if n > limit:
            raise Exhausted(
                f"{n} bytes requested at once, over this server's in-flight limit of {limit}; "
                "split the tensor or raise --max-inflight-bytes / --max-tenant-inflight-bytes",
                self.retry_after,
            )
        async with self._room:
            if not self._fits(tenant, n):
                self.waits += 1
                try:
                    await asyncio.wait_for(
                        self._room.wait_for(lambda: self._fits(tenant, n)), self.wait_seconds
                    )
                except TimeoutError:
                    raise Exhausted(
                        f"server busy: {self.used} of {self.total} bytes in flight "
                        f"({self.by_tenant.get(tenant, 0)} of {self.per_tenant} for tenant "
                        f"{tenant!r}); waited {self.wait_seconds:g} s for room for {n} bytes",
                        self.retry_after,
                    ) from None
            self.used += n
            self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + n
            self.peak = max(self.peak, self.used)
        self._changed()

    def release(self, tenant: str, n: int) -> None:
        """Returns bytes; callable from plain callbacks (no await), on the loop's thread."""
        if not n:
            return
        self.used -= n
        left = self.by_tenant[tenant] - n
        if left:
            self.by_tenant[tenant] = left
        else:
            del self.by_tenant[tenant]
        self._changed()
        # Waking waiters needs the condition's lock, hence a task: release() itself cannot await.
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # the server's loop is gone: nobody is left waiting
            return
        waker = loop.create_task(self._notify())
        self._wakers.add(waker)
        waker.add_done_callback(self._wakers.discard)

    async def _notify(self) -> None:
        async with self._room:
            self._room.notify_all()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.used)


class Account:
    """One call's reservations, released in order as its tensors are answered."""

    def __init__(self, limiter: ByteLimiter, tenant: str) -> None:
        self._limiter = limiter
        self.tenant = tenant
        self.held = 0
        self._closed = False
        self._pending: asyncio.Future | None = None

    async def reserve(self, n: int) -> None:
        if self._closed:
            raise asyncio.CancelledError  # the call is over; nothing may be reserved for it
        await self._limiter.reserve(self.tenant, n)
        self.held += n
        if self._closed:  # closed while we waited: give the bytes straight back
            self._return(self.held)

    def release(self, n: int) -> None:
        n = min(n, self.held)
        self._return(n)

    def hold_until_done(self, future: asyncio.Future) -> None:
        """Keeps the bytes counted until `future` (executor work still reading them) finishes,
        even when the call is cancelled first: the gauge then tells the truth about memory."""
        self._pending = future

    def _return(self, n: int) -> None:
        self.held -= n
        self._limiter.release(self.tenant, n)

    def close(self) -> None:
        self._closed = True
        pending = self._pending
        if pending is not None and not pending.done():
            pending.add_done_callback(lambda _: self._return(self.held))
        else:
            self._return(self.held)


class StreamLimitInterceptor(grpc.aio.ServerInterceptor):
    """Refuses streaming RPCs beyond `max_streams` at once (RESOURCE_EXHAUSTED + retry hint).

    Refusing rather than queueing: a queued stream would still hold a connection and the
    client's data, and the client can retry against another replica.
    """

    def __init__(
        self,
        max_streams: int,
        *,
        retry_after: float = 1.0,
        on_change: Callable[[int], None] | None = None,
    ) -> None:
        self.max_streams = max_streams
        self.retry_after = retry_after
        self.active = 0
        self._on_change = on_change

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if (
            handler is None
            or not (handler.request_streaming or handler.response_streaming)
            or method.startswith(_UNCOUNTED)
        ):
            return handler
        return calls.wrap_handler(handler, method, self._around)

    @contextlib.asynccontextmanager
    async def _around(self, method: str, context: Any) -> AsyncIterator[None]:
        if self.active >= self.max_streams:
            calls.add_trailer(RETRY_TRAILER, str(round(self.retry_after * 1000)))
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"server busy: {self.active} of {self.max_streams} streams open; "
                f"retry in {self.retry_after:g} s",
            )
        self.active += 1
        self._report()
        try:
            yield None
        finally:
            self.active -= 1
            self._report()

    def _report(self) -> None:
        if self._on_change is not None:
            self._on_change(self.active)
