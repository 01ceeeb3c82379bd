"""Server configuration: one frozen record, built from flags or by tests."""

from __future__ import annotations

import dataclasses

MiB = 1024 * 1024


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    # Interface to bind; 127.0.0.1 keeps a laptop server private, 0.0.0.0 serves a cluster.
    host: str = "127.0.0.1"
    # TCP port; 0 picks a free one (tests).
    port: int = 50051
    # Largest gRPC message either way; chunks are <= 4 MiB, so 8 MiB leaves room for headers.
    max_message_bytes: int = 8 * MiB
    # Largest single tensor accepted; bigger ones get RESOURCE_EXHAUSTED before any byte is kept.
    max_tensor_bytes: int = 8 * 1024 * MiB
    # Threads running JAX work, shared by all calls (JAX itself uses every core per call).
    workers: int = 2
    # Seconds in-flight calls get to finish after SIGTERM.
    grace_seconds: float = 10.0
    # Expose gRPC server reflection (for grpcurl and similar tools).
    reflection: bool = True
