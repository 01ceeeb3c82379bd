"""qmill.client: the thin client of a qmill server.

    from qmill.client import Client

    with Client("127.0.0.1:50051") as client:
        for outcome in client.quantize("int8", [("w/kernel", array)]):
            print(outcome.path, outcome.sqnr_db)

`Client` (and `AsyncClient`, for asyncio) owns one channel and has a method per service:
capabilities, quantize, upload, quantize_upload, calibrate, calibrate_language_model,
export_odml, server_info (admin), and `jobs` (submit, get, list, watch, cancel). Every failed
call raises `QmillError`.
Importing this package does not import jax, nor, until one of these names is used, gRPC: the
`qmill` command's in-process runs import only the submodules they use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qmill.client.client import AsyncClient as AsyncClient
    from qmill.client.client import Client as Client
    from qmill.client.credentials import Credentials as Credentials
    from qmill.client.errors import QmillError as QmillError

__all__ = ["AsyncClient", "Client", "Credentials", "QmillError"]


def __getattr__(name: str) -> Any:
    """The public names, imported on first use (PEP 562)."""
    if name in ("AsyncClient", "Client"):
        from qmill.client import client

        return getattr(client, name)
    if name == "Credentials":
        from qmill.client import credentials

        return credentials.Credentials
    if name == "QmillError":
        from qmill.client import errors

        return errors.QmillError
    raise AttributeError(f"module 'qmill.client' has no attribute {name!r}")
