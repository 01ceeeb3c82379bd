"""A server that cannot be reached: the one-line error says what to do, not only gRPC's words
(`failed to connect to all addresses; ... Connection refused`, `... Socket closed`)."""

from __future__ import annotations

import pytest

from qmill.cli import main as cli
from tests.e2e import processes
from tests.integration.auth_test import pki, tls_server  # noqa: F401 (fixtures)


def _error(capsys, *args: str) -> str:
    assert cli.main(["capabilities", *args]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_nothing_listening_says_start_a_server_or_fix_the_address(capsys):
    err = _error(capsys, "--server", f"127.0.0.1:{processes.free_port()}")
    assert "Connection refused" in err and "qmill serve --port" in err and "--server" in err


def test_an_unknown_host_says_check_the_address(capsys):
    err = _error(capsys, "--server", "no-such-host.invalid:50051")
    assert "does not resolve: check --server" in err


@pytest.mark.parametrize(
    ("flags", "hint"),
    [
        ((), "if it uses TLS, pass --tls-ca"),  # a TLS server reached in plaintext
        (("--tls",), "pass the CA that signed it with --tls-ca"),  # a CA this client lacks
    ],
)
def test_a_tls_server_reached_without_its_ca_says_which_flag(tls_server, capsys, flags, hint):  # noqa: F811
    assert hint in _error(capsys, "--server", tls_server.address, *flags)


def test_a_plaintext_server_reached_with_tls_says_leave_it_out(server, pki, capsys):  # noqa: F811
    err = _error(capsys, "--server", server.address, "--tls-ca", str(pki / "ca.pem"))
    assert "does not use TLS: leave out --tls" in err
