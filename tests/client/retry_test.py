"""Which failures the client retries, and how long it waits (issue 18, item 8)."""

from __future__ import annotations

import pytest

from qmill.client import errors, retry


def _failing(*failures: errors.QmillError):
    pending = list(failures)

    def attempt() -> str:
        if pending:
            raise pending.pop(0)
        return "done"

    return attempt


def test_a_busy_server_is_retried_after_at_least_the_delay_it_asks_for():
    waits: list[float] = []
    busy = errors.QmillError(
        "RESOURCE_EXHAUSTED", "in-flight bytes; retry in 2.5 s", retry_after=2.5
    )
    attempt = _failing(busy, busy, busy)
    backoff = retry.Backoff(retries=4, initial_seconds=1.0, factor=2.0)
    lines: list[str] = []
    assert retry.call(attempt, backoff, on_retry=lines.append, sleep=waits.append) == "done"
    assert waits == [2.5, 2.5, 4.0]  # the server's hint, then the backoff once it is longer
    assert all(line.startswith("server busy") for line in lines)


def test_a_busy_server_is_retried_even_if_unavailable_would_not_be():
    # retry_if guards UNAVAILABLE (a wrong address); a refusal with a hint came from a server.
    waits: list[float] = []
    busy = errors.QmillError("RESOURCE_EXHAUSTED", "streams", retry_after=0.1)
    retry.call(
        _failing(busy),
        retry.Backoff(retries=1, initial_seconds=0.0),
        on_retry=lambda _: None,
        retry_if=lambda _: False,
        sleep=waits.append,
    )
    assert waits == [0.1]


def test_a_limit_that_can_never_be_met_is_not_retried():
    never = errors.QmillError("RESOURCE_EXHAUSTED", "tensor over the server's limit")
    waits: list[float] = []
    with pytest.raises(errors.QmillError, match="over the server's limit"):
        retry.call(_failing(never), retry.Backoff(), on_retry=lambda _: None, sleep=waits.append)
    assert waits == []


def test_retries_stay_bounded():
    busy = errors.QmillError("RESOURCE_EXHAUSTED", "busy", retry_after=0.01)
    waits: list[float] = []
    with pytest.raises(errors.QmillError, match="busy"):
        retry.call(
            _failing(*[busy] * 5),
            retry.Backoff(retries=2, initial_seconds=0.0),
            on_retry=lambda _: None,
            sleep=waits.append,
        )
    assert len(waits) == 2


class _Refusal:
    """What grpc raises: code, details and trailing metadata."""

    def __init__(self, trailers):
        self._trailers = trailers

    def code(self):
        import grpc

        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self):
        return "busy"

    def trailing_metadata(self):
        return self._trailers


def test_the_retry_hint_is_read_from_the_servers_trailer():
    assert errors.from_rpc_error(_Refusal((("retry-delay-ms", "1500"),))).retry_after == 1.5
    assert errors.from_rpc_error(_Refusal(())).retry_after is None
    assert errors.from_rpc_error(_Refusal((("retry-delay-ms", "soon"),))).retry_after is None
