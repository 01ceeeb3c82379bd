"""Shared fixtures: a real qmill server on 127.0.0.1 (port 0) running in a background thread.

Every server gets a data directory of its own (jobs db, uploads, calibrations), never the user's
~/.cache/qmill, and nothing is left in /tmp: the fixtures take it from pytest's tmp_path_factory
(pytest keeps the last few runs' for debugging and deletes older ones); a RunningServer made
directly (cancel_test.py's child process) deletes its own when it stops or the process exits.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import threading

import pytest


class RunningServer:
    def __init__(self, **config_fields) -> None:
        from qmill.cli import serve
        from qmill.server import app, config

        # TemporaryDirectory also cleans up at interpreter exit when stop() is never reached.
        self._own_dir: tempfile.TemporaryDirectory[str] | None = None
        if "data_dir" not in config_fields:
            self._own_dir = tempfile.TemporaryDirectory(prefix="qmill-test-")
            config_fields["data_dir"] = self._own_dir.name
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        cfg = config.ServerConfig(host="127.0.0.1", port=0, grace_seconds=1.0, **config_fields)
        self.server = asyncio.run_coroutine_threadsafe(
            app.create_server(cfg, job_peer_backends=serve.job_peer_backends), self._loop
        ).result(60)
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
        if self._own_dir is not None:
            self._own_dir.cleanup()  # after the stop: the job runner writes there until then


# The longest test files, in seconds (call + setup + teardown summed per file, `--durations=0` of a
# whole-suite run on the 2-core VM). xdist runs each file whole on one worker (--dist loadfile) and,
# with --no-loadscope-reorder (pyproject.toml), hands files out in collection order: these go
# first, longest first, so that no long file is left to run alone at the end (by default xdist
# starts the files with the most tests first, and the real-model GPTQ file, one test of ~2.5 min,
# came last). Files not listed follow in their usual order. The numbers only order the files: a
# stale one costs wall time, never a result.
LONGEST_FILES = {
    "tests/interop/lm_real_test.py": 150,
    "tests/engine/golden_test.py": 140,
    "tests/interop/ct_write_test.py": 130,
    "tests/e2e/readme_test.py": 120,
    "tests/integration/fuzz_test.py": 105,
    "tests/e2e/traps_cli_test.py": 60,
    "tests/engine/fast_paths_test.py": 60,
    "tests/e2e/awq_sq_cli_test.py": 60,
    "tests/engine/lm/forward_test.py": 60,
    "tests/engine/parity_qt_test.py": 60,
    "tests/interop/lm_gptq_test.py": 55,
    "tests/integration/fuzz_recipes_test.py": 55,
    "tests/e2e/calibrated_cli_test.py": 50,
    "tests/engine/properties_test.py": 48,
    "tests/e2e/programs_cli_test.py": 41,
    "tests/integration/lm_jobs_test.py": 40,
    "tests/engine/parity_odml_test.py": 40,
    "tests/engine/providers/digits_test.py": 39,
    "tests/e2e/sequence_odml_cli_test.py": 35,
    "tests/e2e/resume_cli_test.py": 32,
    "tests/e2e/killed_clients_test.py": 31,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: -LONGEST_FILES.get(item.nodeid.split("::")[0], 0))  # stable


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _torch_threads()


def _torch_threads() -> None:
    """torch (the reference side of the interop tests, imported once a test module that uses it is
    collected) on cores / workers threads when xdist runs a worker per core. Its default, a thread
    per core in each worker, has the workers' threads wait on each other: transformers' perplexity
    of SmolLM2 (tests/lm_assets.py) took 58 s of CPU on 2 threads and 29 s on one, the same
    number to the last bit, beside another worker."""
    torch = sys.modules.get("torch")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if torch is None or workers <= 1:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`'s worker count: one per core, at most 4. A worker running the language-model
    tests peaks at ~1.5 GB, and past 4 workers the suite is bound by its longest files
    (the real-model GPTQ test alone is ~2 of its minutes)."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    """The XLA compilation cache of every engine this session runs, in-process or in the `qmill`
    processes the tests start (they inherit os.environ), is one of the session's own, never the
    user's ~/.cache/qmill/xla. Shared within the session: later processes load what earlier
    ones compiled, as on a user's machine."""
    os.environ["QMILL_COMPILATION_CACHE"] = str(tmp_path_factory.mktemp("xla-cache"))
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)  # would win over ours


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = RunningServer(data_dir=str(tmp_path_factory.mktemp("server-data")))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def make_server(tmp_path_factory):
    """Starts RunningServer(**config_fields) for tests that need their own options (tokens, TLS,
    limits); every server it started is stopped when the module's tests are done."""
    started: list[RunningServer] = []

    def make(**config_fields) -> RunningServer:
        config_fields.setdefault("data_dir", str(tmp_path_factory.mktemp("server-data")))
        started.append(RunningServer(**config_fields))
        return started[-1]

    yield make
    for running in started:
        running.stop()


@pytest.fixture(scope="session")
def s3():
    """A real S3 endpoint: moto's server on 127.0.0.1, for the whole session.

    s3fs (through botocore) reads the endpoint and credentials from the AWS_* variables when it
    first builds its filesystem; etils.epath and fsspec then keep that filesystem for the
    process, so the variables are set once, before any s3:// path is used, and kept. Yields a
    function that makes an empty bucket and returns its name.
    """
    import itertools
    import os

    import fsspec
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID="test",
        AWS_SECRET_ACCESS_KEY="test",
        AWS_DEFAULT_REGION="us-east-1",
    )
    counter = itertools.count()

    def bucket(prefix: str = "qmill") -> str:
        name = f"{prefix}-{next(counter)}"
        fsspec.filesystem("s3").mkdir(name)
        return name

    yield bucket
    server.stop()


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server on 127.0.0.1 for the whole session (tests/postgres.py);
    `postgres.new_database()` gives each test module a database of its own."""
    from tests.postgres import PostgresServer

    server = PostgresServer()
    yield server
    server.close()
