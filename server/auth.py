"""Bearer tokens: who is calling (tenant) and what they may do (role).

One interceptor checks the `authorization: Bearer <token>` metadata of every RPC except the gRPC
health service (probes carry no secrets) and makes the caller's Principal available to the code
the call runs through `current_principal()`. Servicers scope what they store by
`current_principal().tenant`, answer another tenant's ids with `require_owner` (NOT_FOUND: a
tenant cannot even learn that an id exists), and guard server-wide operations with
`require_admin()`.

Token table format (TOML or JSON file, `--tokens FILE`, or JSON in the QMILL_TOKENS variable): a
mapping from token to {tenant, role}. A key "sha256:<hex>" holds the token's SHA-256 instead of
the token itself, so the file need not contain secrets:

    "k7Fq...long-random..." = { tenant = "team-a", role = "user" }
    "sha256:9f86d0...0f00a08" = { tenant = "ops", role = "admin" }

`--tokens FILE` is re-read when it changes, without a restart (TokenFile): on the request path, at
most once a second, the file's mtime, size and inode are compared with the version in use. A new
version that does not load (bad syntax or entry, missing or empty file) keeps the tokens in use and
logs an error, so a bad edit neither lets everyone in nor locks everyone out. Tokens in
QMILL_TOKENS are fixed until restart.

Under mTLS with --tenant-from-client-cert, a call without a bearer token is tenant <subject CN of
its client certificate>, role user (grpc verified the certificate against --client-ca before the
call reached us). A bearer token, when the server has a table, still decides: admins use tokens.

Without a token table (and without --tenant-from-client-cert) the server has one implicit
principal, tenant "default" with role admin: the laptop case, where whoever can reach the loopback
port owns the server.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import pathlib
import time
import tomllib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc

from qmill.server import calls, errors

log = logging.getLogger(__name__)

ROLES = ("user", "admin")
TOKENS_ENV = "QMILL_TOKENS"
# RPCs anyone may call: load balancers and kubelets probe health without credentials.
PUBLIC_PREFIXES = ("/grpc.health.v1.Health/",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Principal:
    # Whose data: uploads, calibrations and jobs are visible only within one tenant.
    tenant: str
    # "user" (its own tenant's work) or "admin" (also server-wide operations).
    role: str = "user"

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


# Who calls when the server has no token table (see the module docstring).
LOCAL = Principal(tenant="default", role="admin")

_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "qmill_principal", default=None
)


def current_principal() -> Principal:
    """The caller of the RPC this code runs for. Outside an RPC (background jobs, tests) it is the
    implicit LOCAL principal, so jobs must record and pass their own tenant."""
    return _principal.get() or LOCAL


def bound_principal() -> Principal | None:
    """The principal the interceptor bound to this call; None before authentication."""
    return _principal.get()


def require_admin(action: str = "this operation") -> Principal:
    """The caller, when an admin; raises errors.PermissionDenied otherwise."""
    principal = current_principal()
    if not principal.is_admin:
        raise errors.PermissionDenied(
            f"{action} needs an admin token; tenant {principal.tenant!r} has role "
            f"{principal.role!r}"
        )
    return principal


def require_owner(owner_tenant: str, what: str) -> None:
    """Raises errors.NotFound when `what` (e.g. "job 42") belongs to another tenant.

    The message is the one a missing id gets, so ids of other tenants cannot be probed.
    """
    if owner_tenant != current_principal().tenant:
        raise errors.NotFound(f"{what} not found")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


@dataclasses.dataclass(frozen=True)
class TokenTable:
    """Token digests → principals. Only digests are kept, and lookups compare digests in
    constant time, so neither memory dumps nor response timing give tokens away."""

    by_digest: Mapping[bytes, Principal]

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], source: str = "token table") -> TokenTable:
        if not isinstance(mapping, Mapping) or not mapping:
            raise ValueError(f"{source}: expected a non-empty mapping token -> {{tenant, role}}")
        table: dict[bytes, Principal] = {}
        for key, entry in mapping.items():
            where = f"{source}: entry {key[:8]!r}..." if len(key) > 8 else f"{source}: {key!r}"
            if not isinstance(entry, Mapping) or not isinstance(entry.get("tenant"), str):
                raise ValueError(f"{where} needs a table with a string 'tenant'")
            role = entry.get("role", "user")
            if role not in ROLES or not entry["tenant"] or set(entry) - {"tenant", "role"}:
                raise ValueError(
                    f"{where}: tenant must be non-empty, role one of {ROLES}, no other keys"
                )
            if key.startswith("sha256:"):
                try:
                    digest = bytes.fromhex(key.removeprefix("sha256:"))
                except ValueError:
                    digest = b""
                if len(digest) != 32:
                    raise ValueError(f"{where}: sha256: must be followed by 64 hex digits")
            elif key:
                digest = _digest(key)
            else:
                raise ValueError(f"{source}: empty token")
            table[digest] = Principal(tenant=entry["tenant"], role=role)
        return cls(table)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TokenTable:
        """Reads a .json file, or TOML otherwise."""
        path = pathlib.Path(path)
        text = path.read_text()
        try:
            data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"{path}: not valid {path.suffix or 'TOML'}: {e}") from None
        return cls.from_mapping(data, str(path))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> TokenTable | None:
        """The table in QMILL_TOKENS (JSON), or None when it is unset or empty."""
        text = environ.get(TOKENS_ENV, "").strip()
        if not text:
            return None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{TOKENS_ENV}: not valid JSON: {e}") from None
        return cls.from_mapping(data, TOKENS_ENV)

    def principal(self, token: str) -> Principal | None:
        presented = _digest(token)
        found = None
        for digest, principal in self.by_digest.items():  # no early exit: constant time
            if hmac.compare_digest(digest, presented):
                found = principal
        return found


class TokenFile:
    """A token table kept in step with its file (see the module docstring).

    Called on the event loop only. The first load happens here and its errors are raised: a
    server must not start with a table it cannot read.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        check_seconds: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = pathlib.Path(path)
        self.check_seconds = check_seconds
        self._clock = clock
        self._version = self._stat()  # before reading: a change while we read is seen next time
        self.table = TokenTable.load(self.path)
        self._checked = clock()

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()  # follows symlinks: a Kubernetes Secret swaps its ..data link
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def current(self) -> TokenTable:
        """The table in use, re-reading the file first when it is due and has changed."""
        now = self._clock()
        if now - self._checked >= self.check_seconds:
            self._checked = now
            version = self._stat()
            if version != self._version:
                self._version = version  # a bad version is reported once, not every second
                self._reload()
        return self.table

    def _reload(self) -> None:
        try:
            table = TokenTable.load(self.path)
        except (OSError, ValueError, UnicodeDecodeError) as e:
            log.error(
                "token file not reloaded, keeping the %d tokens in use: %s",
                len(self.table.by_digest),
                e,
            )
            return
        self.table = table
        log.info("token file %s reloaded: %d tokens", self.path, len(table.by_digest))

    def principal(self, token: str) -> Principal | None:
        return self.current().principal(token)


def _bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            value = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def _common_name(context: Any) -> str | None:
    """The subject CN of the call's verified client certificate, if any."""
    names = context.auth_context().get("x509_common_name") or ()
    for name in names:
        return name.decode() if isinstance(name, bytes) else str(name)
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks the bearer token (or client certificate) of every non-health RPC; binds the
    caller's Principal."""

    def __init__(
        self, tokens: TokenTable | TokenFile | None, *, tenant_from_client_cert: bool = False
    ) -> None:
        self._tokens = tokens
        self._from_cert = tenant_from_client_cert

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(PUBLIC_PREFIXES):
            return handler
        return calls.wrap_handler(handler, method, self._around)

    @contextlib.asynccontextmanager
    async def _around(self, method: str, context: Any) -> AsyncIterator[None]:
        principal = await self._authenticate(context)
        # Lives in this call's task (and tasks it starts); never reset, the task ends with it.
        _principal.set(principal)
        if principal is not LOCAL:
            calls.annotate(tenant=principal.tenant)
        yield None

    async def _authenticate(self, context: Any) -> Principal:
        # Runs as the call starts: like its peer (server/calls.py), a call's auth context must not
        # be read after a client cancel has freed it.
        token = _bearer(context.invocation_metadata())
        if token and self._tokens is not None:
            principal = self._tokens.principal(token)
            if principal is None:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid or revoked token")
            return principal
        if self._from_cert:
            name = _common_name(context)
            if not name:
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "no bearer token, and no client certificate subject CN to name a tenant",
                )
            return Principal(tenant=name, role="user")
        if self._tokens is None:
            return LOCAL
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing bearer token: pass --token or set QMILL_TOKEN "
            "(metadata 'authorization: Bearer <token>')",
        )
        raise AssertionError("unreachable")  # abort raises
