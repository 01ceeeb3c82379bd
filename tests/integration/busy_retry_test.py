"""Clients wait out a busy server instead of failing (issue 18, item 8): real server on 127.0.0.1.

With little in-flight room and a short queue, concurrent `qmill quantize --server` runs get
RESOURCE_EXHAUSTED with the server's retry hint; they used to fail (6 of 6 within 1.4 s). Now
each retries after the hinted delay and resumes, and every output is the one-client output.
"""

from __future__ import annotations

import threading

from qmill import checkpoints
from qmill.checkpoints.formats import examples
from qmill.cli import main as cli


def _tree(path) -> dict:
    with checkpoints.open_source(path) as source:
        return {e.path: source.read(e.path).tobytes() for e in source.entries()}


def test_concurrent_clients_all_finish_on_a_server_with_little_room(make_server, tmp_path):
    # 40 kB of in-flight room holds one of the example's tensors (the largest is 32 kB) at a time;
    # a call waits at most 50 ms for room, then is refused with "retry in ... s".
    server = make_server(max_inflight_bytes=40_000, max_wait_seconds=0.05)
    source = tmp_path / "src.npz"
    examples.write_example_checkpoint(source, "npz")
    codes: dict[int, int] = {}

    def run(i: int) -> None:
        argv = ["quantize", str(source), "-o", str(tmp_path / f"out{i}.npz"), "-q"]
        codes[i] = cli.main([*argv, "--server", server.address, "--retries", "20"])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert codes == dict.fromkeys(range(6), 0)
    alone = tmp_path / "alone.npz"
    assert cli.main(["quantize", str(source), "-o", str(alone), "-q"]) == 0
    for i in range(6):
        assert _tree(tmp_path / f"out{i}.npz") == _tree(alone)
