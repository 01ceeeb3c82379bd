"""A real PostgreSQL server for tests: the distribution's binaries, a data directory in /tmp,
listening on 127.0.0.1 only, stopped (and deleted) when the session ends.

PostgreSQL refuses to run as root, and tests run as root in CI: then initdb and pg_ctl run as
the unprivileged user `nobody`, in a directory it owns. The binaries come from PATH or from
/usr/lib/postgresql/<version>/bin (Debian's layout); `.ci/run` installs the `postgresql` package
where they are missing. Durability is off (fsync, full-page writes): a test database need not
survive a power cut, and it starts and writes faster.
"""

from __future__ import annotations

import glob
import itertools
import os
import pathlib
import pwd
import shutil
import socket
import subprocess
import tempfile

USER = "qmill"  # the database superuser initdb creates (trust authentication, loopback only)


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    versions = sorted(
        glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
        key=lambda p: int(pathlib.Path(p).parts[-3]),
    )
    if not versions:
        raise RuntimeError(
            f"PostgreSQL's {name} was not found (PATH, /usr/lib/postgresql/*/bin): install the "
            "server, e.g. apt-get install postgresql (.ci/run does it)"
        )
    return versions[-1]


class PostgresServer:
    """initdb + pg_ctl start; `url(db)` names a database, `restart()` restarts the server."""

    def __init__(self) -> None:
        # As root, everything runs as an unprivileged user, which must own the directory and
        # reach it: under /tmp (sticky, world-traversable), whatever $TMPDIR says.
        self._user = _unprivileged_user() if os.geteuid() == 0 else None
        where = "/tmp" if self._user is not None else None
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="qmill-pg-", dir=where))
        if self._user is not None:
            os.chown(self.root, self._user.pw_uid, self._user.pw_gid)
        self.data = self.root / "data"
        self.port = _free_port()
        self._names = itertools.count()
        self._run(
            _binary("initdb"), "-D", str(self.data), "-U", USER, "--auth=trust", "-E", "UTF8",
            "--no-sync",
        )  # fmt: skip
        self.start()

    def _run(self, *args: str) -> None:
        user = None if self._user is None else self._user.pw_uid
        group = None if self._user is None else self._user.pw_gid
        result = subprocess.run(
            args, user=user, group=group, extra_groups=[] if user is not None else None,
            capture_output=True, text=True, cwd=self.root, timeout=120,
        )  # fmt: skip
        if result.returncode != 0:
            log = self.root / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(f"{args[0]} failed: {result.stderr or result.stdout}\n{tail}")

    def _pg_ctl(self, *args: str) -> None:
        self._run(_binary("pg_ctl"), "-D", str(self.data), "-w", "-t", "60", *args)

    def start(self) -> None:
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off "
            "-c full_page_writes=off -c synchronous_commit=off -c max_connections=100"
        )
        self._pg_ctl("-l", str(self.root / "server.log"), "-o", options, "start")

    def stop(self) -> None:
        self._pg_ctl("-m", "fast", "stop")

    def restart(self) -> None:
        self.stop()
        self.start()

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database; returns its URL."""
        import psycopg

        name = f"qmill_{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def close(self) -> None:
        try:
            self._pg_ctl("-m", "immediate", "stop")
        except RuntimeError:
            pass  # already stopped (a test failed between stop() and start())
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def _unprivileged_user() -> pwd.struct_passwd:
    """`nobody` (every Debian has it), else `postgres` (the server package's)."""
    for name in ("nobody", "postgres"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError(
        "PostgreSQL refuses to run as root and there is no `nobody` or `postgres` user to run "
        "it as; create one (useradd --system nobody)"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
