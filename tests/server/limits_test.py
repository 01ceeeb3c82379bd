"""The in-flight byte limiter: totals, tenants, waiting, timeouts and release on every path."""

from __future__ import annotations

import asyncio

import pytest

from qmill.server import errors, limits


def _limiter(total=100, per_tenant=60, wait=5.0, seen=None):
    return limits.ByteLimiter(
        total,
        per_tenant,
        wait_seconds=wait,
        retry_after=0.5,
        on_change=None if seen is None else seen.append,
    )


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


def test_a_tenant_at_its_cap_waits_while_another_tenant_proceeds():
    async def run():
        lim = _limiter()
        await lim.reserve("a", 60)
        blocked = asyncio.create_task(lim.reserve("a", 10))
        await asyncio.sleep(0.05)
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
        with pytest.raises(limits.Exhausted) as e:
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
        with pytest.raises(limits.Exhausted, match="over this server's in-flight limit of 60"):
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
        lim = _limiter()
        await lim.reserve("a", 60)
        waiter = asyncio.create_task(lim.reserve("a", 10))
        await asyncio.sleep(0.02)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        lim.release("a", 60)
        await asyncio.sleep(0)
        return lim

    lim = asyncio.run(run())
    assert (lim.used, lim.by_tenant) == (0, {})
