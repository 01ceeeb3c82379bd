"""When the server may serve plaintext, and what it warns about."""

from __future__ import annotations

import pytest

from qmill.server import auth, config, tls

TOKENS = auth.TokenTable.from_mapping({"t": {"tenant": "a"}})


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_without_flags_is_allowed_with_a_warning(host):
    (warning,) = tls.check_transport(config.ServerConfig(host=host))
    assert "plaintext on loopback" in warning


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "qmill.internal"])
def test_other_interfaces_need_tls_or_insecure(host):
    with pytest.raises(ValueError, match="without TLS: pass --tls-cert"):
        tls.check_transport(config.ServerConfig(host=host))
    warnings = tls.check_transport(config.ServerConfig(host=host, insecure=True, tokens=TOKENS))
    assert len(warnings) == 1 and "--insecure" in warnings[0]
    warnings = tls.check_transport(config.ServerConfig(host=host, tls_cert="c", tls_key="k"))
    assert len(warnings) == 1 and "no --tokens" in warnings[0]
    cfg = config.ServerConfig(host=host, tls_cert="c", tls_key="k", tokens=TOKENS)
    assert tls.check_transport(cfg) == []


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tls_cert": "c"}, "go together"),
        ({"tls_key": "k"}, "go together"),
        ({"client_ca": "ca"}, "needs --tls-cert"),
    ],
)
def test_incomplete_tls_flags_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        tls.check_transport(config.ServerConfig(**fields))


def test_tenant_from_client_cert_needs_mtls():
    tls_only = {"tls_cert": "c", "tls_key": "k", "tenant_from_client_cert": True}
    with pytest.raises(ValueError, match="needs mTLS"):
        tls.check_transport(config.ServerConfig(**tls_only))
    assert tls.check_transport(config.ServerConfig(**tls_only, client_ca="ca")) == []
