"""The in-flight byte limiter: totals, tenants, the first-come-first-served queue, timeouts and
release on every path."""

from __future__ import annotations

import asyncio

import pytest

from qmill.server import errors, limits


def _limiter(total=100, per_tenant=60, wait=5.0, seen=None, waiting=None):
    return limits.ByteLimiter(
        total,
        per_tenant,
        wait_seconds=wait,
        retry_after=0.5,
        on_change=None if seen is None else seen.append,
        on_waiting=None if waiting is None else waiting.append,
    )


async def _queue(lim, order, *requests):
    """Starts one reservation per (name, tenant, n), in this order; each appends its name to
    `order` when granted. Returns the tasks once all of them are queued."""

    async def reserve(name, tenant, n):
        await lim.reserve(tenant, n)
        order.append(name)

    tasks = []
    for name, tenant, n in requests:
        tasks.append(asyncio.create_task(reserve(name, tenant, n)))
        await asyncio.sleep(0)  # let it reach the queue before the next one arrives
    return tasks


def test_reserve_and_release_track_totals_tenants_and_peak():
    async def run():
        seen = []
        lim = _limiter(seen=seen)
        await lim.reserve("a", 40)
        await lim.reserve("b", 50)
        assert (lim.used, lim.by_tenant) == (90, {"a": 40, "b": 50})
        lim.release("a", 40)
        lim.release("b", 50)
        await asyncio.sleep(0)
        return lim, seen

    lim, seen = asyncio.run(run())
    assert (lim.used, lim.by_tenant, lim.peak) == (0, {}, 90)
    assert seen == [40, 90, 50, 0]  # the gauge callback follows every change


async def _tenant_a_full_and_waiting(seconds: float):
    """A limiter whose tenant a holds its whole 60-byte cap, and a task of a's asking for 10
    more, given `seconds` to (not) get them."""
    lim = _limiter()
    await lim.reserve("a", 60)
    waiter = asyncio.create_task(lim.reserve("a", 10))
    await asyncio.sleep(seconds)
    return lim, waiter


def test_a_tenant_at_its_cap_waits_while_another_tenant_proceeds():
    async def run():
        lim, blocked = await _tenant_a_full_and_waiting(0.05)
        assert not blocked.done()  # tenant a is at its 60-byte cap
        await asyncio.wait_for(lim.reserve("b", 30), 1)  # tenant b is not
        lim.release("a", 60)
        await asyncio.wait_for(blocked, 1)
        return lim

    lim = asyncio.run(run())
    assert lim.by_tenant == {"a": 10, "b": 30} and lim.waits == 1


def test_timeout_gives_resource_exhausted_with_a_retry_hint():
    async def run():
        lim = _limiter(wait=0.05)
        await lim.reserve("a", 60)
        with pytest.raises(errors.ResourceExhausted) as e:
            await lim.reserve("b", 50)
        return lim, e.value

    lim, exc = asyncio.run(run())
    code, message = errors.status_for(exc)
    assert code.name == "RESOURCE_EXHAUSTED"
    assert "server busy: 60 of 100 bytes in flight" in message and "retry in 0.5 s" in message
    assert exc.retry_after == 0.5
    assert lim.used == 60  # the refused reservation left nothing behind


def test_a_request_that_can_never_fit_fails_at_once():
    async def run():
        with pytest.raises(
            errors.ResourceExhausted, match="over this server's in-flight limit of 60"
        ):
            await _limiter(wait=60).reserve("a", 61)

    asyncio.run(asyncio.wait_for(run(), 5))


def test_account_returns_what_a_call_still_holds_when_it_ends():
    async def run():
        lim = _limiter()
        acct = limits.Account(lim, "a")
        await acct.reserve(20)
        await acct.reserve(30)
        acct.release(20)
        assert lim.used == 30
        acct.close()
        with pytest.raises(asyncio.CancelledError):
            await acct.reserve(1)  # a finished call reserves nothing more
        return lim

    assert asyncio.run(run()).used == 0


def test_account_keeps_bytes_counted_until_running_work_finishes():
    async def run():
        lim = _limiter()
        acct = limits.Account(lim, "a")
        await acct.reserve(40)
        work = asyncio.get_running_loop().create_future()
        acct.hold_until_done(work)
        acct.close()  # the call was cancelled while the engine still reads the bytes
        assert lim.used == 40
        work.set_result(None)
        await asyncio.sleep(0)
        return lim

    assert asyncio.run(run()).used == 0


def test_cancelled_waiter_takes_nothing():
    async def run():
        lim, waiter = await _tenant_a_full_and_waiting(0.02)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        lim.release("a", 60)
        await asyncio.sleep(0)
        return lim

    lim = asyncio.run(run())
    assert (lim.used, lim.by_tenant) == (0, {})


def test_waiters_are_granted_in_arrival_order_and_small_ones_do_not_pass_a_big_one():
    async def run():
        waiting, order = [], []
        lim = _limiter(per_tenant=100, waiting=waiting)
        await lim.reserve("x", 60)
        await lim.reserve("x", 40)
        tasks = await _queue(lim, order, ("big", "a", 80), ("s1", "b", 10), ("s2", "c", 10))
        assert lim.waiting == 3 and waiting[-1] == 3
        lim.release("x", 40)  # 40 free: room for s1 and s2, but big is first in line
        await asyncio.sleep(0.02)
        assert order == [] and lim.waiting == 3
        lim.release("x", 60)
        await asyncio.wait_for(asyncio.gather(*tasks), 1)
        return lim, order, waiting

    lim, order, waiting = asyncio.run(run())
    assert order == ["big", "s1", "s2"]
    assert (lim.used, lim.waiting, waiting[-1], lim.waits) == (100, 0, 0, 3)


def test_a_big_request_is_not_starved_by_a_stream_of_small_ones():
    async def run():
        lim = _limiter(per_tenant=100)
        for _ in range(10):
            await lim.reserve("small", 10)
        order = []
        (big,) = await _queue(lim, order, ("big", "big", 50))
        smalls = []
        # Small calls keep finishing and new ones keep arriving; without a queue each new one
        # would take the 10 bytes just freed and the big one would wait forever.
        for released in range(1, 11):
            lim.release("small", 10)
            smalls += await _queue(lim, order, (f"s{released}", "small", 10))
            await asyncio.sleep(0)
            if big.done():
                break
        state = released, list(order), lim.waiting, dict(lim.by_tenant)
        for task in smalls:
            task.cancel()
        await asyncio.gather(*smalls, return_exceptions=True)
        return state

    released, order, waiting, by_tenant = asyncio.run(run())
    # The big one went as soon as 50 bytes were free, before any small one that came after it.
    assert (released, order, waiting) == (5, ["big"], 5)
    assert by_tenant == {"small": 50, "big": 50}


def test_a_waiter_that_times_out_leaves_the_queue_and_lets_the_next_one_go():
    async def run():
        lim = _limiter(per_tenant=100, wait=0.2)
        await lim.reserve("x", 90)
        order = []
        (big,) = await _queue(lim, order, ("big", "a", 50))
        await asyncio.sleep(0.1)
        (small,) = await _queue(lim, order, ("small", "b", 10))  # fits, but waits behind big
        assert order == [] and lim.waiting == 2
        with pytest.raises(errors.ResourceExhausted) as e:
            await big
        await asyncio.sleep(0)
        assert small.done() and order == ["small"]  # granted when big left, not at its own timeout
        return lim, e.value

    lim, exc = asyncio.run(asyncio.wait_for(run(), 5))
    assert "(0 of 100 for tenant 'a'), 1 other calls waiting; waited 0.2 s for room for 50" in str(
        exc
    )
    assert (lim.used, lim.waiting) == (100, 0)


def test_a_cancelled_waiter_leaves_the_queue_at_once_and_frees_nothing_it_did_not_hold():
    async def run():
        lim = _limiter(per_tenant=100)
        await lim.reserve("x", 90)
        order = []
        big, small = await _queue(lim, order, ("big", "a", 50), ("small", "b", 10))
        big.cancel()  # e.g. the client cancelled, or the call's deadline passed
        with pytest.raises(asyncio.CancelledError):
            await big
        assert lim.waiting == 0  # left at once; small was granted as big left
        await asyncio.wait_for(small, 1)
        assert order == ["small"]
        return lim

    lim = asyncio.run(run())
    assert lim.by_tenant == {"x": 90, "b": 10}


def test_a_waiter_cancelled_just_as_it_was_granted_hands_the_bytes_on():
    async def run():
        lim = _limiter(per_tenant=100)
        await lim.reserve("x", 100)
        order = []
        first, second = await _queue(lim, order, ("first", "a", 60), ("second", "b", 40))
        lim.release("x", 60)  # grants `first` synchronously...
        first.cancel()  # ...which is cancelled before it could run again
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.wait_for(second, 1)
        return lim, order

    lim, order = asyncio.run(run())
    assert order == ["second"] and lim.by_tenant == {"x": 40, "b": 40} and lim.waiting == 0
