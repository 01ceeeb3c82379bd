"""Batch jobs spread over replicas: the backend a job quantizes with when --job-peers is set.

A job then does what `qmill quantize --server a,b,c` does (client/fanout.py): this server reads
the source and writes the destination, and the tensors go to every peer that has room; a peer
that dies mid-job is dropped and its unanswered tensors go to the others. The checkpoint is the
one a lone server writes, byte for byte (job.quantize_checkpoint writes in checkpoint order
whatever order the answers come in). When every peer has failed the job fails with the last
error; its partial output stays, so submitting it again resumes.

Peers are resolved when each job starts (a `dns:` name follows a Deployment's scaling); the
option's syntax is checked when the server starts.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

from qmill.client import credentials, embedded, errors, fanout, job
from qmill.server import config as config_lib

log = logging.getLogger(__name__)


def backend_factory(config: config_lib.ServerConfig) -> Callable[[], job.Backend]:
    """What makes each job's backend: the in-process engine, or a FanoutClient over the peers.

    Raises:
        ValueError: --job-peers names no server, or a `dns:` entry has no port.
    """
    spec = config.job_peers
    if not spec:
        return embedded.EmbeddedClient
    # Syntax only: names are resolved per job, when the replicas behind them may have changed.
    fanout.parse_targets(spec, resolve=lambda host, port: [host])
    creds = credentials.Credentials.from_files(
        tls=config.job_peer_tls_ca is not None,
        tls_ca=config.job_peer_tls_ca,
        token=config.job_peer_token,
        environ={},  # not the server's own QMILL_TOKEN: peers get job_peer_token or nothing
    )

    def lost(address: str, error: errors.QmillError) -> None:
        log.warning("job peer %s failed (%s); its tensors go to the others", address, error.code)

    def make() -> job.Backend:
        return fanout.FanoutClient(spec, credentials=creds, on_replica_lost=lost)

    return make


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
