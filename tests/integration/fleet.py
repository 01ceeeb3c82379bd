"""Test-only: a fleet of `qmill serve` replicas sharing one PostgreSQL job queue and one S3 bucket.

Each replica is a real `qmill serve` process on 127.0.0.1 with a data directory of its own (as
pods have), whose checkpoint reads sleep a little (tests/checkpoints/slow_reads.py) so a test can
act while a job runs. Its log goes to a file the test reads (which replica claimed a job, what
it resumed).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import subprocess
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from qmill.client import Client, credentials
from tests.checkpoints import slow_reads

TOKENS = {
    "token-a": {"tenant": "team-a", "role": "user"},
    "token-b": {"tenant": "team-b", "role": "user"},
    "token-ops": {"tenant": "ops", "role": "admin"},
}


class Replica:
    def __init__(
        self, name: str, work: pathlib.Path, db_url: str, url_root: str, *, read_delay: float
    ) -> None:
        self.name = name
        self._config = (work, db_url, url_root, read_delay)
        self.data = work / name
        self.data.mkdir(parents=True, exist_ok=True)
        self.log_path = work / f"{name}.log"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        # The URL through the environment, as the manifests pass it (a Secret's key).
        env = {**os.environ, "QMILL_JOBS_DB": db_url, "QMILL_TOKENS": json.dumps(TOKENS)}
        args = [
            *slow_reads.qmill_command(read_delay),
            "serve", "--port", str(self.port), "--grace", "1", "--data-dir", str(self.data),
            "--jobs-url-root", url_root, "--job-lease-seconds", "2", "--max-tenant-jobs", "1",
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def health(self, service: str = "") -> int | None:
        """The health status of `service` ("": readiness), None when it does not answer."""
        with grpc.insecure_channel(self.address) as channel:
            try:
                return (
                    health_pb2_grpc.HealthStub(channel)
                    .Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                    .status
                )
            except grpc.RpcError:
                return None

    def wait_ready(self, seconds: float = 120) -> None:
        deadline = time.monotonic() + seconds
        while self.health() != health_pb2.HealthCheckResponse.SERVING:
            assert self.process.poll() is None, f"{self.name} exited:\n{self.log()[-3000:]}"
            assert time.monotonic() < deadline, f"{self.name} not ready:\n{self.log()[-3000:]}"
            time.sleep(0.3)

    def client(self, token: str = "token-a") -> Client:
        creds = credentials.Credentials.from_files(token=token)
        return Client(self.address, timeout=30, credentials=creds)

    def claimed(self, job_id: str) -> int:
        """How often this replica claimed the job (its log says so)."""
        return len(re.findall(rf"job {job_id} claimed by", self.log()))

    def replacement(self) -> Replica:
        """A new replica with the same settings (a Deployment replacing a killed pod)."""
        work, db_url, url_root, read_delay = self._config
        return Replica(self.name + "-new", work, db_url, url_root, read_delay=read_delay)

    def kill(self) -> None:
        self.process.kill()  # SIGKILL: no draining, the lease is left to lapse
        self.process.wait(30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def start(work: pathlib.Path, db_url: str, url_root: str, n: int = 3, read_delay: float = 0.4):
    replicas = [
        Replica(f"replica-{i}", work, db_url, url_root, read_delay=read_delay) for i in range(n)
    ]
    for replica in replicas:
        replica.wait_ready()
    return replicas


def runner_of(replicas: list[Replica], job_id: str, seconds: float = 60) -> Replica:
    """The replica that claimed the job last (waits until one has)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        claimed = [r for r in replicas if r.process.poll() is None and r.claimed(job_id)]
        if claimed:
            return claimed[-1]
        time.sleep(0.1)
    raise AssertionError(f"no replica claimed job {job_id}")
