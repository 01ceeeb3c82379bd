"""Where a job may read and write: a tenant's job paths are confined to the tenant's directory.

A job's source and destination are paths on the server, so on a shared server they must not
reach another tenant's files or the server's own. Three modes, from the server's options:

- `--jobs-root DIR`: each tenant's paths are inside `DIR/<tenant>/`. A relative path is taken
  from there. An absolute path is accepted only when it already lies inside it (a client on the
  server's machine may pass full paths) and refused otherwise, never re-rooted: `/data/ckpt`
  silently meaning `DIR/<tenant>/data/ckpt` would surprise more than an error naming the
  directory. After symlinks are resolved (os.path.realpath) the path must stay inside, so `..`
  and symlinks cannot leave it; a source directory's own symlinks are checked the same way. The
  job keeps the resolved path. Without tokens the one tenant is "default": `DIR/default/`.
- tokens (or tenants from client certificates) without `--jobs-root`: several tenants share the
  server and no directory is theirs, so SubmitJob with a server path is refused
  (FAILED_PRECONDITION) until the operator sets `--jobs-root`.
- neither: the single-user mode (a laptop, loopback, no auth): any path the server's user may
  read or write, as `qmill quantize` itself would.

Object-store URLs (gs://, s3://) are refused unless the operator names URL roots
(`--jobs-url-root`); then a tenant's URLs must lie below `<root>/<tenant>/` of one of them, in
every mode, "default" being the one tenant of a server without tokens (as with --jobs-root).
urls.py has the parsing; a URL is never resolved or re-rooted, only checked.

The check runs at submit time and again in the runner just before the job starts, so a symlink
planted after the submit cannot take a job outside. It does not close the window between that
second check and the job's own file opens (that would need openat/O_NOFOLLOW in every reader and
writer): tenant directories should be writable only by the server and their tenant.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

from qmill.checkpoints.base import staging
from qmill.server import config as config_lib
from qmill.server import errors, tls
from qmill.server.jobs import urls


@dataclasses.dataclass(frozen=True, kw_only=True)
class PathPolicy:
    """How SubmitJob and the runner turn a job's paths into paths on the server."""

    # Directory of one directory per tenant; None: no confinement (see the module docstring).
    jobs_root: str | None = None
    # The server authenticates callers, so several tenants may share it.
    multi_tenant: bool = False
    # Object-store prefixes of one prefix per tenant (--jobs-url-root); empty: URLs refused.
    url_roots: tuple[str, ...] = ()
    # Single-user mode reachable from the network without --allow-open-jobs: the host it listens
    # on, and server paths are refused; None: not the case.
    open_host: str | None = None

    @classmethod
    def from_config(cls, config: config_lib.ServerConfig) -> PathPolicy:
        """The policy of a server; raises ValueError when --jobs-root is not a directory."""
        root = config.jobs_root
        if root is not None:
            if not os.path.isdir(root):
                raise ValueError(
                    f"--jobs-root {root} is not a directory; create it (with one directory per "
                    "tenant inside) or leave the option out"
                )
            root = os.path.abspath(root)
        multi_tenant = config.tokens is not None or config.tenant_from_client_cert
        url_roots = tuple(str(u) for u in urls.parse_roots(tuple(config.jobs_url_roots)))
        open_to_network = (
            not (multi_tenant or root is not None or tls.is_loopback(config.host))
            and not config.allow_open_jobs
        )
        return cls(
            jobs_root=root,
            multi_tenant=multi_tenant,
            url_roots=url_roots,
            open_host=config.host if open_to_network else None,
        )

    def describe(self) -> str:
        """One line for the server's startup log."""
        if self.jobs_root is not None:
            local = f"job paths confined to {self.jobs_root}/<tenant>/"
        elif self.multi_tenant:
            local = (
                "jobs with server paths are refused: tokens are set but --jobs-root is not "
                "(set it to confine each tenant's jobs to its own directory)"
            )
        elif self.open_host is not None:
            local = (
                f"jobs with server paths are refused: no tokens on {self.open_host} "
                "(set --tokens, --jobs-root, a loopback --host, or --allow-open-jobs)"
            )
        else:
            local = (
                "jobs may read and write any path this server's user can (single-user mode: no "
                "tokens, no --jobs-root)"
            )
        if not self.url_roots:
            return local + "; object-store URLs refused (no --jobs-url-root)"
        prefixes = ", ".join(f"{r}/<tenant>/" for r in self.url_roots)
        return f"{local}; job URLs confined to {prefixes}"

    def tenant_dir(self, tenant: str) -> str:
        """`<jobs_root>/<tenant>`; raises when the tenant's name cannot be one directory."""
        assert self.jobs_root is not None
        return os.path.join(self.jobs_root, _tenant_segment(tenant))

    def resolve(self, tenant: str, value: str, what: str) -> str:
        """The server path a job of `tenant` uses for `value` (its `what`: source, destination).

        Raises:
          ValueError: empty, an object-store URL, or outside the tenant's directory
            (INVALID_ARGUMENT).
          errors.FailedPrecondition: when this server cannot take server paths.
        """
        if not value:
            raise ValueError(f"{what} is empty; give a path on the server")
        if urls.is_url(value):
            return self._resolve_url(tenant, value, what)
        if self.jobs_root is None:
            if self.multi_tenant:
                raise errors.FailedPrecondition(
                    f"this server does not run jobs on server paths ({what} {value!r}): it has "
                    "several tenants but no jobs directory; the operator must start it with "
                    "--jobs-root DIR (each tenant's jobs then use DIR/<tenant>/)"
                )
            if self.open_host is not None:
                raise errors.FailedPrecondition(
                    f"this server does not run jobs on server paths ({what} {value!r}): it "
                    f"listens on {self.open_host} without tokens, so anyone reaching the port "
                    "could read and write every file its user can; the operator must set "
                    "--tokens (with --jobs-root), serve on loopback, or pass --allow-open-jobs"
                )
            return os.path.abspath(value)
        base = self.tenant_dir(tenant)
        real_base = os.path.realpath(base)
        # join keeps an absolute value as it is: it must then already be inside (see above).
        real = os.path.realpath(os.path.join(base, value))
        if not _inside(real, real_base):
            raise ValueError(
                f"{what} {value!r} is outside your jobs directory: job paths must be in {base}/ "
                "(relative paths are taken from there; '..' and symlinks may not leave it)"
            )
        return real

    def check_job(self, tenant: str, source: str, destination: str) -> tuple[str, str]:
        """The (source, destination) a job runs with, checked again as the job starts.

        Also checks what the job will touch beside the two paths: symlinks inside a source
        directory and the destination's partial output, which a tenant could have made point
        elsewhere. Raises as `resolve` does.
        """
        real_source = self.resolve(tenant, source, "source")
        real_destination = self.resolve(tenant, destination, "destination")
        if self.jobs_root is not None:
            # A URL's objects cannot be links; its local copy lives in the job's scratch.
            if not urls.is_url(real_source):
                self._check_tree(tenant, real_source)
            if not urls.is_url(real_destination):
                partial = real_destination + staging.PARTIAL_SUFFIX
                self.resolve(tenant, partial, "partial output")
        return real_source, real_destination

    def _resolve_url(self, tenant: str, value: str, what: str) -> str:
        """`value` checked against the tenant's prefixes (see the module docstring)."""
        if not self.url_roots:
            raise ValueError(
                f"{what} {value!r}: object-store URLs (gs://, s3://, ...) are not supported by "
                "this server: the operator must start it with --jobs-url-root URL (e.g. "
                "s3://bucket/jobs; each tenant's jobs then use URL/<tenant>/), or copy the "
                "checkpoint to the server's filesystem and give its path"
            )
        url = urls.parse(value, what)
        roots = urls.parse_roots(self.url_roots)
        prefixes = urls.tenant_prefixes(roots, _tenant_segment(tenant))
        if not any(url.is_below(prefix) for prefix in prefixes):
            raise ValueError(
                f"{what} {value!r} is outside your object-store jobs prefix: job URLs must be "
                f"below {' or '.join(f'{p}/' for p in prefixes)}"
            )
        return str(url)

    def _check_tree(self, tenant: str, source: str) -> None:
        """Refuses a source directory with a symlink that resolves outside the tenant's."""
        if not os.path.isdir(source):
            return
        for parent, dirs, files in os.walk(source):  # followlinks=False: links checked, not walked
            for name in (*dirs, *files):
                path = os.path.join(parent, name)
                if os.path.islink(path):
                    self.resolve(tenant, path, f"source file {os.path.relpath(path, source)}")


def _tenant_segment(tenant: str) -> str:
    """`tenant`, when it can be one directory (or URL segment); raises otherwise."""
    if tenant in ("", ".", "..") or "/" in tenant or "\\" in tenant or "\0" in tenant:
        raise errors.FailedPrecondition(
            f"tenant {tenant!r} cannot name a directory under the jobs root; the operator "
            "must give it a name without '/' (and not '.' or '..') in the token table"
        )
    return tenant


def _inside(path: str, directory: str) -> bool:
    """Whether `path` is below `directory` (both resolved and absolute). The directory itself is
    not: as a destination it would be replaced whole, with its staging copy in the jobs root."""
    return path != directory and pathlib.PurePath(path).is_relative_to(directory)
