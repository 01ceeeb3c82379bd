"""Shared fixtures: a real qmill server on 127.0.0.1 (port 0) running in a background thread."""

from __future__ import annotations

import asyncio
import tempfile
import threading

import pytest


class RunningServer:
    def __init__(self, **config_fields) -> None:
        from qmill.server import app, config

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        # A data directory of its own (jobs db, uploads): never the user's ~/.cache/qmill.
        config_fields.setdefault("data_dir", tempfile.mkdtemp(prefix="qmill-test-"))
        cfg = config.ServerConfig(host="127.0.0.1", port=0, grace_seconds=1.0, **config_fields)
        self.server = asyncio.run_coroutine_threadsafe(app.create_server(cfg), self._loop).result(
            60
        )
        self.address = f"127.0.0.1:{self.server.port}"

    def stop(self, grace: float = 0.5) -> None:
        """Stops the server (calls still running get `grace` seconds); a second stop is a no-op,
        so a test may stop a server early that make_server stops again at the end."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.server.stop(grace), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@pytest.fixture(scope="module")
def server():
    running = RunningServer()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def make_server():
    """Starts RunningServer(**config_fields) for tests that need their own options (tokens, TLS,
    limits); every server it started is stopped when the module's tests are done."""
    started: list[RunningServer] = []

    def make(**config_fields) -> RunningServer:
        started.append(RunningServer(**config_fields))
        return started[-1]

    yield make
    for running in started:
        running.stop()
