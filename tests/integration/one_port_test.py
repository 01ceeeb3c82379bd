"""One server per port: a second server on a port already served is refused, naming the port.

gRPC sets SO_REUSEPORT by default, so without qmill's guard a second `qmill serve --port P` starts
and logs "serving on ...:P" while the kernel shares the connections between the two servers.
"""

from __future__ import annotations

import asyncio

import pytest

from qmill.server import app, config, errors


def _start_on(port: int, tmp_path) -> None:
    cfg = config.ServerConfig(host="127.0.0.1", port=port, data_dir=str(tmp_path))
    loop = asyncio.new_event_loop()
    try:
        server = loop.run_until_complete(app.create_server(cfg))
        loop.run_until_complete(server.stop(0))  # only reached when the bind succeeded
    finally:
        loop.close()


def test_a_second_server_on_a_served_port_is_refused(server, tmp_path):
    with pytest.raises(errors.FailedPrecondition, match=f"port {server.server.port} on 127.0.0.1"):
        _start_on(server.server.port, tmp_path)


def test_gRPC_itself_refuses_the_port_without_the_early_check(server, tmp_path, monkeypatch):
    # The early check gives the clean message; SO_REUSEPORT off is what makes the bind fail when
    # the port is taken between the check and gRPC's bind.
    monkeypatch.setattr(app, "_check_port_free", lambda config: None)
    with pytest.raises(errors.FailedPrecondition, match="already in use"):
        _start_on(server.server.port, tmp_path)
