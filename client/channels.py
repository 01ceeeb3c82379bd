"""gRPC channels to a qmill server carrying a Credentials' TLS and per-call metadata.

The metadata (credentials.Credentials.metadata: the bearer token, x-request-id) is added by
client interceptors, so RPCs added later get it without further code.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import grpc

from qmill.client.credentials import Credentials


class _Details(
    collections.namedtuple(
        "_Details",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


def _with(metadata: Any, extra: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    return [*(metadata or ()), *extra]


class _SyncMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, extra: Sequence[tuple[str, str]]) -> None:
        self._extra = extra

    def _details(self, d: Any) -> _Details:
        return _Details(
            d.method,
            d.timeout,
            _with(d.metadata, self._extra),
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def _aio_details(d: grpc.aio.ClientCallDetails, extra: Sequence[tuple[str, str]]) -> Any:
    return grpc.aio.ClientCallDetails(
        d.method, d.timeout, grpc.aio.Metadata(*_with(d.metadata, extra)), d.credentials,
        d.wait_for_ready,
    )  # fmt: skip


class _AioMetadata:
    """Adds the credentials' metadata to every call of one kind (grpc.aio files an interceptor
    under the first kind it subclasses, so each kind needs a class of its own; see _AIO_KINDS)."""

    def __init__(self, extra: Sequence[tuple[str, str]]) -> None:
        self._extra = extra

    async def _intercept(self, continuation, client_call_details, request_or_iterator):
        return await continuation(
            _aio_details(client_call_details, self._extra), request_or_iterator
        )


_AIO_KINDS = tuple(
    type(f"_Aio{kind.__name__}", (_AioMetadata, kind), {method: _AioMetadata._intercept})
    for kind, method in (
        (grpc.aio.UnaryUnaryClientInterceptor, "intercept_unary_unary"),
        (grpc.aio.UnaryStreamClientInterceptor, "intercept_unary_stream"),
        (grpc.aio.StreamUnaryClientInterceptor, "intercept_stream_unary"),
        (grpc.aio.StreamStreamClientInterceptor, "intercept_stream_stream"),
    )
)


def channel(target: str, credentials: Credentials, options: Sequence[tuple[str, Any]]) -> Any:
    """A grpc.Channel to `target`, TLS or plaintext, adding the credentials' metadata to calls."""
    creds = credentials.channel_credentials()
    # No compression: tensor bytes barely compress (the server does not compress either).
    kwargs = {"options": list(options), "compression": grpc.Compression.NoCompression}
    if creds is None:
        ch = grpc.insecure_channel(target, **kwargs)
    else:
        ch = grpc.secure_channel(target, creds, **kwargs)
    extra = credentials.metadata()
    return grpc.intercept_channel(ch, _SyncMetadata(extra)) if extra else ch


def aio_channel(
    target: str, credentials: Credentials, options: Sequence[tuple[str, Any]]
) -> grpc.aio.Channel:
    """The asyncio counterpart of `channel`."""
    creds = credentials.channel_credentials()
    extra = credentials.metadata()
    interceptors = [kind(extra) for kind in _AIO_KINDS] if extra else None
    kwargs = {
        "options": list(options),
        "compression": grpc.Compression.NoCompression,
        "interceptors": interceptors,
    }
    if creds is None:
        return grpc.aio.insecure_channel(target, **kwargs)
    return grpc.aio.secure_channel(target, creds, **kwargs)
