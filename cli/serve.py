"""`qmill serve`, composed: the server, given the fan-out client its batch jobs spread over.

A batch job with --job-peers does what `qmill quantize --server a,b,c` does (client/fanout.py):
this server reads the source and writes the destination, and the tensors go to every peer that
has room; a peer that dies mid-job is dropped and its unanswered tensors go to the others. The
server knows nothing of the client library; it receives `job_peer_backends` from here.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from qmill.checkpoints.base import errors
from qmill.checkpoints.run import pipeline
from qmill.client import credentials, fanout

if TYPE_CHECKING:
    from qmill.server import config as config_lib

log = logging.getLogger("qmill.server.jobs.peers")


def job_peer_backends(config: config_lib.ServerConfig) -> Callable[[], pipeline.Backend]:
    """What makes each job's backend: a FanoutClient over --job-peers.

    Peers are resolved when each job starts (a `dns:` name follows a Deployment's scaling); the
    option's syntax is checked now, when the server starts.

    Raises:
        ValueError: --job-peers names no server, or a `dns:` entry has no port.
    """
    spec = config.job_peers
    fanout.parse_targets(spec, resolve=lambda host, port: [host])
    creds = credentials.Credentials.from_files(
        tls=config.job_peer_tls_ca is not None,
        tls_ca=config.job_peer_tls_ca,
        token=config.job_peer_token,
        environ={},  # not the server's own QMILL_TOKEN: peers get job_peer_token or nothing
    )

    def lost(address: str, error: errors.QmillError) -> None:
        log.warning("job peer %s failed (%s); its tensors go to the others", address, error.code)

    def make() -> pipeline.Backend:
        return fanout.FanoutClient(spec, credentials=creds, on_replica_lost=lost)

    return make


def run(args: argparse.Namespace) -> int:
    from qmill.server import command  # lazy: the server pulls in jax

    return command.run(args, job_peer_backends=job_peer_backends)
