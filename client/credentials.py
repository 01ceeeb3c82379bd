"""How a client reaches a qmill server: TLS / mTLS channel credentials and per-call metadata.

Every call of a channel made from these (qmill.client.channels) carries `authorization: Bearer
<token>` when a token is known (`--token`, else the QMILL_TOKEN environment variable) and
`x-request-id` when one is set. Importing this module does not import gRPC: the flags it adds
are parsed by every command, in-process quantize included, which never opens a channel.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
        import grpc  # lazy: see the module's docstring

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


# add_arguments' flags, each the from_files argument of the same name.
_FLAGS = ("tls", "tls_ca", "tls_cert", "tls_key", "token", "request_id")


def from_args(args: argparse.Namespace) -> Credentials:
    return Credentials.from_files(**{flag: getattr(args, flag) for flag in _FLAGS})
