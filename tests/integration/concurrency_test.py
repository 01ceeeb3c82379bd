"""16 clients quantizing at once: every result bit-identical to a lone run, and the server's
in-flight bytes (as its limiter counts them) never above the configured limit."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np

from qmill.client import Client

CLIENTS = 16
KiB = 1024
LIMIT = 512 * KiB  # four of the largest tensors below: far fewer than 16 clients want at once
RECIPE = {
    "rules": [
        {"path_regex": ".*/b/kernel", "qtype": "int4", "tile_size": 32},
        {"path_regex": ".*", "qtype": "int8", "calibration_method": "minmax"},
    ]
}


def _tensors(client: int):
    rng = np.random.default_rng(client)
    return [
        (f"c{client}/a/kernel", rng.normal(size=(128, 256)).astype(np.float32)),  # 128 KiB
        (f"c{client}/a/bias", rng.normal(size=(256,)).astype(np.float32)),
        (f"c{client}/b/kernel", rng.normal(size=(256, 64)).astype(ml_dtypes.bfloat16)),
        (f"c{client}/c/kernel", rng.normal(size=(64, 512)).astype(np.float32)),  # 128 KiB
    ]


def _quantize(address: str, client: int):
    with Client(address, timeout=120) as c:
        return {
            o.path: {name: (p.dtype, p.tobytes()) for name, p in o.parts.items()}
            for o in c.quantize(RECIPE, _tensors(client))
        }


def test_sixteen_concurrent_clients_match_lone_runs_within_the_inflight_limit(make_server):
    running = make_server(
        max_inflight_bytes=LIMIT, max_tenant_inflight_bytes=LIMIT, max_concurrent_streams=CLIENTS
    )
    lone = {i: _quantize(running.address, i) for i in range(CLIENTS)}  # one at a time
    limiter = running.server.limiter
    limiter.peak = 0

    results: dict[int, object] = {}
    start = threading.Barrier(CLIENTS)

    def client(i: int) -> None:
        start.wait()
        try:
            results[i] = _quantize(running.address, i)
        except Exception as e:  # reported below with the client's number
            results[i] = e

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)

    failures = {i: r for i, r in results.items() if isinstance(r, Exception)}
    assert not failures and len(results) == CLIENTS, failures
    for i in range(CLIENTS):
        assert results[i].keys() == lone[i].keys()
        assert results[i] == lone[i], f"client {i} differs from its lone run"
        assert results[i][f"c{i}/b/kernel"]["qvalue"][0] == np.dtype(ml_dtypes.int4)
    assert 128 * KiB <= limiter.peak <= LIMIT
    assert limiter.used == 0 and running.server.metrics.value("qmill_inflight_bytes") == 0
