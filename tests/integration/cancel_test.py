"""Clients that walk away mid-stream must never take the server down.

grpc frees a call's state once the client cancels; reading the context's peer afterwards (as the
per-call log line once did) crashed the whole process with a segfault. The server runs in a child
process here so such a crash fails this test instead of killing pytest.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    import numpy as np
    from conftest import RunningServer
    from qmill.client import Client

    server = RunningServer()
    tensors = lambda: ((f"t{{j}}", np.ones((64, 64), np.float32)) for j in range(100))
    for mode in ("cancel", "close_channel_first"):
        for _ in range(15):
            client = Client(server.address)
            results = client.quantize({{"rules": [{{"qtype": "int8"}}]}}, tensors())
            next(results)
            if mode == "cancel":
                results.close()
                client.close()
            else:
                client.close()
                try:
                    results.close()
                except Exception:
                    pass
    with Client(server.address) as client:
        one = [("w", np.ones((8, 8), np.float32))]
        (outcome,) = client.quantize({{"rules": [{{"qtype": "int8"}}]}}, one)
        assert outcome.quantized
    server.stop()
    print("server survived")
    """
)


def test_cancelled_calls_leave_the_server_running(tmp_path) -> None:
    tests = str(pathlib.Path(__file__).parents[1])
    script = _SCRIPT.format(tests=tests)
    result = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", script],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "server survived" in result.stdout
