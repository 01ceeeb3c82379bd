"""Batch jobs spread over replicas: which backend a job quantizes with, and how it went.

With --job-peers the backend is a fan-out client over the peers, made by the composition root
(qmill.cli.serve) and handed to the server: the server never imports the client. The checkpoint
is the one a lone server writes, byte for byte (pipeline.quantize_checkpoint writes in checkpoint
order whatever order the answers come in). When every peer has failed the job fails with the
last error; its partial output stays, so submitting it again resumes.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from qmill.checkpoints.run import embedded, pipeline
from qmill.server import config as config_lib

# Made in the composition root (qmill.cli.serve): config → a maker of fan-out backends.
JobPeerBackends = Callable[[config_lib.ServerConfig], Callable[[], pipeline.Backend]]


def backend_factory(
    config: config_lib.ServerConfig, job_peer_backends: JobPeerBackends | None = None
) -> Callable[[], pipeline.Backend]:
    """What makes each job's backend: the in-process engine, or `job_peer_backends`' fan-out
    client when --job-peers is set.

    Raises:
        ValueError: --job-peers is set but no fan-out client was given, or its syntax is wrong.
    """
    if not config.job_peers:
        return embedded.EmbeddedClient
    if job_peer_backends is None:
        raise ValueError(
            "--job-peers needs the fan-out client, which `qmill serve` provides; "
            "a server built in Python must pass job_peer_backends=qmill.cli.serve.job_peer_backends"
        )
    return job_peer_backends(config)


def describe_spread(backend: object) -> str:
    """`` over 3 peers (a: 6, b: 5, c: 5 tensors)`` after a fanned-out job; empty otherwise."""
    answered_by = getattr(backend, "answered_by", None)
    if not answered_by:
        return ""
    counts = collections.Counter(answered_by.values())
    parts = ", ".join(f"{address}: {n}" for address, n in sorted(counts.items()))
    lost = getattr(backend, "lost", {})
    dropped = f"; lost {', '.join(sorted(lost))}" if lost else ""
    peers = f"{len(counts)} peer{'s' if len(counts) > 1 else ''}"
    return f" over {peers} ({parts} tensors{dropped})"
