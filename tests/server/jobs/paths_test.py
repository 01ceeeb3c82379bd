"""Server paths in single-user mode are only for the owner (issue 18, item 11).

`--host 0.0.0.0 --insecure` without tokens let anyone who reaches the port run jobs that read
and write any file the server's user can.
"""

from __future__ import annotations

import pytest

from qmill.server import config as config_lib
from qmill.server import errors
from qmill.server.jobs import paths as paths_lib


def _policy(**fields) -> paths_lib.PathPolicy:
    return paths_lib.PathPolicy.from_config(config_lib.ServerConfig(**fields))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "qmill.internal"])
def test_single_user_mode_on_the_network_refuses_server_paths(host):
    policy = _policy(host=host, insecure=True, jobs_root=None)
    with pytest.raises(errors.FailedPrecondition, match="--allow-open-jobs"):
        policy.resolve("default", "/etc/passwd", "source")
    assert "refused" in policy.describe()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1"])
def test_single_user_mode_on_loopback_takes_any_path(host, tmp_path):
    policy = _policy(host=host, jobs_root=None)
    assert policy.resolve("default", str(tmp_path / "x"), "source") == str(tmp_path / "x")


def test_the_operator_may_allow_open_jobs_explicitly(tmp_path):
    policy = _policy(host="0.0.0.0", insecure=True, jobs_root=None, allow_open_jobs=True)
    assert policy.resolve("default", str(tmp_path / "x"), "source") == str(tmp_path / "x")


def test_a_jobs_root_confines_jobs_on_the_network_too(tmp_path):
    (tmp_path / "default").mkdir()
    policy = _policy(host="0.0.0.0", insecure=True, jobs_root=str(tmp_path))
    assert policy.resolve("default", "in.npz", "source") == str(tmp_path / "default" / "in.npz")
