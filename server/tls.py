"""Transport security: TLS / mTLS credentials and the policy on when plaintext is allowed.

Policy (also in the README):
- Loopback (127.0.0.0/8, ::1, localhost) with no flags: plaintext, no tokens, with a warning. Only
  local processes can connect, and a laptop keeps working with zero configuration.
- Any other interface: TLS (`--tls-cert` + `--tls-key`) is required, unless `--insecure` says that
  plaintext is intended (e.g. TLS terminated by a mesh sidecar); that logs a warning.
- `--client-ca` turns on mTLS: clients must present a certificate signed by that CA.
  `--tenant-from-client-cert` (needs mTLS) makes the certificate's subject CN the tenant of calls
  that carry no bearer token (server/auth.py).
"""

from __future__ import annotations

import ipaddress
import pathlib

import grpc

from qmill.server import config as config_lib


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname: it may resolve to anything


def check_transport(config: config_lib.ServerConfig) -> list[str]:
    """Raises ValueError for a configuration the policy refuses; returns warnings to log."""
    if (config.tls_cert is None) != (config.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    tls = config.tls_cert is not None
    if config.client_ca is not None and not tls:
        raise ValueError("--client-ca (mTLS) needs --tls-cert and --tls-key")
    if config.tenant_from_client_cert and config.client_ca is None:
        raise ValueError(
            "--tenant-from-client-cert needs mTLS (--client-ca): only a certificate the server "
            "verified may name a tenant"
        )
    warnings = []
    if not tls:
        if config.insecure:
            warnings.append(
                f"--insecure: serving plaintext on {config.host}; tokens and tensors travel "
                "unencrypted"
            )
        elif is_loopback(config.host):
            warnings.append(
                f"serving plaintext on loopback {config.host}: fine for local use; any local "
                "user can connect. Use --tls-cert/--tls-key and --tokens to share this server"
            )
        else:
            raise ValueError(
                f"refusing to serve {config.host} without TLS: pass --tls-cert and --tls-key "
                "(and --client-ca for mTLS), or --insecure if plaintext is intended"
            )
    if config.tokens is None and config.client_ca is None and not is_loopback(config.host):
        warnings.append(
            "no --tokens: every caller is an admin of tenant 'default' (set --tokens or "
            "QMILL_TOKENS to authenticate callers)"
        )
    return warnings


def server_credentials(config: config_lib.ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the configured PEM files, or None for plaintext."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    key = pathlib.Path(config.tls_key).read_bytes()
    chain = pathlib.Path(config.tls_cert).read_bytes()
    client_ca = pathlib.Path(config.client_ca).read_bytes() if config.client_ca else None
    return grpc.ssl_server_credentials(
        [(key, chain)],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )
