"""How a client reaches a qmill server: TLS / mTLS channel credentials and per-call metadata.

Every call of a channel made here carries `authorization: Bearer <token>` when a token is known
(`--token`, else the QMILL_TOKEN environment variable) and `x-request-id` when one is set, through
client interceptors, so RPCs added later get them without further code.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

TOKEN_ENV = "QMILL_TOKEN"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Credentials:
    # Use TLS. With no ca_cert the system's root certificates verify the server.
    tls: bool = False
    # PEM CA certificate(s) that the server's certificate must chain to.
    ca_cert: bytes | None = None
    # PEM client certificate chain and key, for servers that require mTLS.
    cert_chain: bytes | None = None
    private_key: bytes | None = None
    # Bearer token (tenant + role on the server); None sends none.
    token: str | None = dataclasses.field(default=None, repr=False)
    # Sent as x-request-id with every call (the server makes one up when absent) and echoed back
    # in the trailing metadata; lets a user find a run's lines in the server's log.
    request_id: str | None = None

    @classmethod
    def from_files(
        cls,
        *,
        tls: bool = False,
        tls_ca: str | os.PathLike[str] | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        token: str | None = None,
        request_id: str | None = None,
        environ: Mapping[str, str] = os.environ,
    ) -> Credentials:
        """Reads PEM files; the token falls back to QMILL_TOKEN. Any TLS file implies TLS."""
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")

        def read(path: str | os.PathLike[str] | None) -> bytes | None:
            return None if path is None else pathlib.Path(path).read_bytes()

        return cls(
            tls=tls or any(p is not None for p in (tls_ca, tls_cert, tls_key)),
            ca_cert=read(tls_ca),
            cert_chain=read(tls_cert),
            private_key=read(tls_key),
            token=token or environ.get(TOKEN_ENV) or None,
            request_id=request_id,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_cert,
            private_key=self.private_key,
            certificate_chain=self.cert_chain,
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        items = []
        if self.token:
            items.append(("authorization", f"Bearer {self.token}"))
        if self.request_id:
            items.append(("x-request-id", self.request_id))
        return tuple(items)


def default() -> Credentials:
    """Plaintext, with the token from QMILL_TOKEN if set (what a Client uses when given none)."""
    return Credentials.from_files()


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The connection flags shared by every command that talks to a server."""
    group = parser.add_argument_group("connection")
    group.add_argument("--tls", action="store_true", help="use TLS with the system's root CAs")
    group.add_argument("--tls-ca", metavar="PEM", help="CA that signed the server's certificate")
    group.add_argument("--tls-cert", metavar="PEM", help="client certificate (mTLS)")
    group.add_argument("--tls-key", metavar="PEM", help="client private key (mTLS)")
    group.add_argument(
        "--token", help=f"bearer token (default: ${TOKEN_ENV}; the variable keeps it out of ps)"
    )
    group.add_argument("--request-id", help="x-request-id sent with every call (for the logs)")


def from_args(args: argparse.Namespace) -> Credentials:
    return Credentials.from_files(
        tls=args.tls,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        token=args.token,
        request_id=args.request_id,
    )
