"""The one exception of qmill's checkpoint pipeline, whoever does the quantizing.

The pipeline runs with the in-process engine, one server or several; each backend reports a
failure the same way, as a status name and a message a user can act on, so the CLI and the
server's job runner handle one type. The client raises it for every failed RPC
(`qmill.client.errors` maps gRPC status → QmillError).
"""

from __future__ import annotations


class QmillError(Exception):
    """A failed call or job. `code` is the gRPC status name (e.g. "INVALID_ARGUMENT")."""

    def __init__(self, code: str, details: str, *, retry_after: float | None = None) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details
        # Seconds the server asked to wait before trying again (a limit that will free up).
        self.retry_after = retry_after
