"""Backpressure: bytes in flight (server-wide and per tenant) and concurrent streams.

Tensor bytes are reserved as they arrive, before they are copied into the buffer that assembles
them, so memory for assembled tensors never exceeds `max_inflight_bytes` whatever the number of
clients. What a header claims is not reserved at once, only its first RESERVE_STEP_BYTES: the
reservation grows with the data, so a client that announces a huge tensor and then stalls holds
little, and one that stalls mid-tensor is ended after `idle_seconds` (DEADLINE_EXCEEDED), its
bytes given back (issue 39: a stalled client no longer locks its tenant out). A call that
finds no room queues (that is the backpressure: its client's sends stall), first come, first
served, for at most `max_wait_seconds`, then gets RESOURCE_EXHAUSTED with a retry hint in the
message and in the `retry-delay-ms` trailing metadata. A request that could never fit fails at
once. A cancelled call, or one whose deadline passes, leaves the queue at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import numpy as np

from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import auth, calls, errors

log = logging.getLogger(__name__)

# How much more a tensor's reservation grows by at a time as its data arrives (four chunks): a
# header alone holds at most this much, whatever size it claims; steps keep the limiter off the
# per-chunk path.
RESERVE_STEP_BYTES = 4 * wire.MAX_CHUNK_BYTES

# Services whose streams do not count against max_concurrent_streams (health Watch is a probe).
_UNCOUNTED = auth.PUBLIC_PREFIXES


class _Waiter:
    """A reservation waiting its turn; `granted` is set once its bytes are counted."""

    __slots__ = ("granted", "n", "tenant")

    def __init__(self, tenant: str, n: int, granted: asyncio.Future) -> None:
        self.tenant = tenant
        self.n = n
        self.granted = granted


class ByteLimiter:
    """Counts reserved bytes, server-wide and per tenant; reservations that find no room queue.

    The queue is first come, first served: a waiter is granted as soon as it fits, and no later
    waiter passes one that is blocked by the server-wide limit, so a big tensor is never starved
    by a stream of small ones. The one exception keeps tenants apart: a waiter blocked only by its
    own tenant's cap lets other tenants' waiters pass (never its own tenant's), and once its tenant
    has room it is again the oldest in line for server-wide room.

    Runs on the server's event loop only (reservations come from coroutines; releases from
    coroutines or callbacks on the loop's thread). Granting happens in `release`, synchronously:
    bytes handed to a waiter are counted at once, so nothing can slip in between.
    """

    def __init__(
        self,
        total: int,
        per_tenant: int,
        *,
        wait_seconds: float,
        idle_seconds: float | None = None,
        retry_after: float = 1.0,
        on_change: Callable[[int], None] | None = None,
        on_waiting: Callable[[int], None] | None = None,
    ) -> None:
        self.total = total
        self.per_tenant = per_tenant
        self.wait_seconds = wait_seconds
        # Seconds a call may send nothing while a tensor of it is partly received (its bytes
        # held); then it ends with DEADLINE_EXCEEDED. None: no limit.
        self.idle_seconds = idle_seconds
        self.retry_after = retry_after
        self.used = 0
        self.peak = 0
        self.waits = 0  # reservations that had to wait for room (a sign the limit was binding)
        self.by_tenant: dict[str, int] = {}
        self._on_change = on_change
        self._on_waiting = on_waiting
        self._queue: collections.deque[_Waiter] = collections.deque()

    @property
    def waiting(self) -> int:
        """Reservations queued for room now."""
        return len(self._queue)

    def _fits_total(self, n: int) -> bool:
        return self.used + n <= self.total

    def _fits_tenant(self, tenant: str, n: int) -> bool:
        return self.by_tenant.get(tenant, 0) + n <= self.per_tenant

    def check_fits(self, n: int) -> None:
        """Raises ResourceExhausted when `n` bytes could never be held at once."""
        limit = min(self.total, self.per_tenant)
        if n > limit:
            raise errors.ResourceExhausted(
                f"{n} bytes requested at once, over this server's in-flight limit of {limit}; "
                "split the tensor or raise --max-inflight-bytes / --max-tenant-inflight-bytes",
                self.retry_after,
            )

    async def reserve(self, tenant: str, n: int) -> None:
        """Waits its turn for room for `n` bytes.

        Raises:
            errors.ResourceExhausted: at once when `n` is over the limit itself; after
                `wait_seconds` in the queue when room did not come.
            asyncio.CancelledError: the call was cancelled (or its deadline passed) while waiting;
                it leaves the queue and holds nothing.
        """
        self.check_fits(n)
        waiter = _Waiter(tenant, n, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        self._grant()  # at once when nobody it must respect is ahead and it fits
        if waiter.granted.done():
            return
        self.waits += 1
        self._report_waiting()
        try:
            async with asyncio.timeout(self.wait_seconds):
                await asyncio.shield(waiter.granted)
        except BaseException as e:
            busy = (
                f"server busy: {self.used} of {self.total} bytes in flight "
                f"({self.by_tenant.get(tenant, 0)} of {self.per_tenant} for tenant {tenant!r}), "
                f"{len(self._queue) - 1} other calls waiting; waited {self.wait_seconds:g} s "
                f"for room for {n} bytes"
            )
            if waiter.granted.done():  # granted just as it gave up: hand the bytes on
                self.release(tenant, n)
            else:
                waiter.granted.cancel()
                self._queue.remove(waiter)
                self._report_waiting()
                self._grant()  # it may have been the one holding others back
            if isinstance(e, TimeoutError):
                raise errors.ResourceExhausted(busy, self.retry_after) from None
            raise

    def release(self, tenant: str, n: int) -> None:
        """Returns bytes and grants waiters that now fit; callable from plain callbacks."""
        if not n:
            return
        self.used -= n
        left = self.by_tenant[tenant] - n
        if left:
            self.by_tenant[tenant] = left
        else:
            del self.by_tenant[tenant]
        self._changed()
        self._grant()

    def _grant(self) -> None:
        """Grants queued waiters in order while they fit (see the class docstring)."""
        capped: set[str] = set()  # tenants whose oldest waiter is held by the tenant cap
        granted = False
        for waiter in list(self._queue):
            if waiter.tenant in capped:
                continue
            if not self._fits_tenant(waiter.tenant, waiter.n):
                capped.add(waiter.tenant)
                continue
            if not self._fits_total(waiter.n):
                break  # first in line for server-wide room: nobody behind it goes first
            self._queue.remove(waiter)
            self.used += waiter.n
            self.by_tenant[waiter.tenant] = self.by_tenant.get(waiter.tenant, 0) + waiter.n
            self.peak = max(self.peak, self.used)
            waiter.granted.set_result(None)
            granted = True
        if granted:
            self._changed()
            self._report_waiting()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.used)

    def _report_waiting(self) -> None:
        if self._on_waiting is not None:
            self._on_waiting(len(self._queue))


class Account:
    """One call's reservations, released in order as its tensors are answered."""

    def __init__(self, limiter: ByteLimiter, tenant: str) -> None:
        self.limiter = limiter
        self.tenant = tenant
        self.held = 0
        self._closed = False
        self._pending: asyncio.Future | None = None

    async def reserve(self, n: int) -> None:
        if self._closed:
            raise asyncio.CancelledError  # the call is over; nothing may be reserved for it
        await self.limiter.reserve(self.tenant, n)
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
        self.limiter.release(self.tenant, n)

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
            calls.add_trailer(errors.RETRY_TRAILER, str(round(self.retry_after * 1000)))
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


class TensorInbox:
    """The one receiving flow of the server's request streams (tensors, calibration batches).

    Each announced tensor is checked against the limits (one that could never fit fails at once)
    and its first RESERVE_STEP_BYTES reserved, then wire.Receiver reassembles it from the chunks
    that follow, the reservation growing a step at a time before the bytes that need it are
    copied. Tensors come one at a time: a header while the previous tensor still lacks bytes
    means that one was cut short (DATA_LOSS). Read the requests through `requests()`: it ends a
    call that stalls mid-tensor.
    """

    def __init__(self, max_bytes: int, account: Account | None, *, what: str = "tensor") -> None:
        self._max_bytes = max_bytes
        self._account = account
        # What the stream calls its tensors ("batch"), for the messages.
        self._what = what
        self._receiver = wire.Receiver()
        self._current: wire.Assembler | None = None
        self._reserved = 0  # of the current tensor's bytes
        self._received = 0

    @property
    def receiving(self) -> bool:
        """True while an announced tensor still lacks bytes."""
        return self._receiver.receiving

    async def requests(self, requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """`requests`, ended with DEADLINE_EXCEEDED when the client sends nothing for the
        limiter's idle_seconds while a tensor of it is partly received (its bytes held)."""
        idle = self._account.limiter.idle_seconds if self._account is not None else None
        it = aiter(requests)
        while True:
            try:
                if idle is None or not self.receiving:
                    request = await anext(it)
                else:
                    async with asyncio.timeout(idle):
                        request = await anext(it)
            except StopAsyncIteration:
                return
            except TimeoutError:
                label = self._current.header.path or "<unnamed>"
                raise errors.DeadlineExceeded(
                    f"{self._what} {label}: nothing received for {idle:g} s after "
                    f"{self._received} of {self._current.header.byte_length} bytes (the server's "
                    "--idle-timeout); the call is ended and its bytes are given back"
                ) from None
            yield request

    async def announce(self, header: pb.TensorHeader) -> None:
        self.close()
        self._current = None
        account = self._account
        if account is not None and header.byte_length <= self._max_bytes:
            # Over max_bytes (or not matching its shape) the Assembler refuses it below, before
            # allocating anything.
            account.limiter.check_fits(header.byte_length)
        # Uninitialized: its pages take memory only as the reserved bytes are copied in.
        current = wire.Assembler(header, max_bytes=self._max_bytes)
        self._current, self._reserved, self._received = current, 0, 0
        await self._reserve(min(header.byte_length, RESERVE_STEP_BYTES))
        self._receiver.start(current)

    async def add(self, chunk: pb.TensorChunk | wire.Chunk) -> None:
        if not self._receiver.receiving:
            raise ValueError(f"a chunk arrived before any {self._what} header")
        chunk = wire.chunk_of(chunk)
        end = self._received + len(chunk.data)
        if end > self._reserved:
            # Past the announced length the Assembler refuses the chunk: reserve no more.
            total = self._current.header.byte_length
            await self._reserve(min(max(end, self._reserved + RESERVE_STEP_BYTES), total))
        self._receiver.add(chunk)
        self._received = end

    async def _reserve(self, upto: int) -> None:
        """Grows the current tensor's reservation to `upto` bytes."""
        if self._account is not None and upto > self._reserved:
            await self._account.reserve(upto - self._reserved)
        self._reserved = max(self._reserved, upto)

    def take(self) -> list[tuple[pb.TensorHeader, np.ndarray]]:
        """The tensor the last announce or add completed, with its header (or nothing): by then
        all its bytes (header.byte_length) are reserved, for the caller to release."""
        return [(self._current.header, array) for _, array in self._receiver.take()]

    def close(self) -> None:
        """Raises DATA_LOSS when the stream ends (or the next header comes) mid-tensor."""
        if self._receiver.receiving:
            self._current.finish()
