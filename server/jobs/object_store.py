"""Copying a job's checkpoint between an object store (gs://, s3://) and the server's disk.

Through etils.epath, the storage layer Orbax already uses: it maps gs:// and s3:// onto fsspec
filesystems (gcsfs, s3fs), which read their credentials and endpoint the usual way
(GOOGLE_APPLICATION_CREDENTIALS, AWS_* variables, instance metadata). Those packages are the
optional `objectstore` extra; a server without the one a URL needs says so at submit.

What an upload guarantees (object stores have no rename, and no atomic directory at all):
- a file (npz, safetensors) goes to a temporary object beside the destination, which is then
  copied onto the destination's name by the store itself: the name holds the old object (or
  none) until the new one is there whole, never a partial one;
- a directory (Orbax, sharded safetensors) goes under a temporary prefix beside the destination
  and is then copied under the destination's prefix, the last step of the job; if that copy
  fails, what it had copied is deleted, so a failed job leaves no files at the destination. While
  it runs (a server-side copy per file) a reader listing the prefix can see some of the files.
The temporary name is fixed per job (`.NAME.qmill-upload-<job id>`), so a job resumed after a
crash replaces its own leftovers, and it is deleted whenever the upload ends.
"""

from __future__ import annotations

import importlib.util
import logging
import pathlib
from collections.abc import Callable, Iterator

from etils import epath
from etils.epath import backend

from qmill.server import errors

log = logging.getLogger(__name__)

# The optional dependencies that make gs:// and s3:// work (pyproject.toml).
EXTRA = "objectstore"
# The module fsspec imports for each scheme.
_FILESYSTEMS = {"gs": "gcsfs", "s3": "s3fs"}
# Bytes per read while copying: between reads a job can be cancelled.
_CHUNK = 8 * 1024 * 1024
_UPLOAD_TAG = ".qmill-upload-"


def require_filesystem(url: str) -> None:
    """Raises FAILED_PRECONDITION when the package for `url`'s scheme is not installed."""
    scheme = url.partition("://")[0]
    module = _FILESYSTEMS[scheme]
    if importlib.util.find_spec(module) is None:
        raise errors.FailedPrecondition(
            f"this server cannot reach {scheme}:// URLs ({url}): the {module} package is not "
            f"installed; the operator must install the {EXTRA} extra "
            f"(pip install 'qmill[{EXTRA}]')"
        )


def exists(url: str) -> bool:
    """Whether an object or a prefix with objects is at `url`.

    Raises:
      errors.FailedPrecondition, errors.Unavailable: the store refused or failed.
    """
    try:
        return epath.Path(url).exists()
    except PermissionError as e:
        raise errors.FailedPrecondition(f"the server's credentials may not read {url}: {e}") from e
    except OSError as e:
        raise errors.Unavailable(f"object store error on {url}: {e}; retry") from e


def download(url: str, local: pathlib.Path, check: Callable[[], None]) -> None:
    """Copies the object or tree at `url` to `local` (a file or directory of the same shape)."""
    remote = epath.Path(url)
    if not remote.is_dir():
        _copy(remote, local, check)
        return
    local.mkdir(parents=True, exist_ok=True)
    for file in _files(remote):
        relative = str(file)[len(str(remote)) + 1 :]
        _copy(file, local / relative, check)


def upload(
    local: pathlib.Path, url: str, *, tag: str, overwrite: bool, check: Callable[[], None]
) -> None:
    """Copies the file or directory `local` to `url` (see the module docstring for how).

    `tag` names the temporary object or prefix (the job id); `check` may raise to stop before
    the final step.

    Raises:
      FileExistsError: something appeared at `url` meanwhile and `overwrite` is False.
    """
    destination = epath.Path(url)
    temporary = destination.parent / f".{destination.name}{_UPLOAD_TAG}{tag}"
    # Relative names of the files; "" for a single file.
    names = (
        [f.relative_to(local).as_posix() for f in sorted(local.rglob("*")) if f.is_file()]
        if local.is_dir()
        else [""]
    )
    _remove(temporary)  # a crashed attempt's
    try:
        for name in names:
            _copy(local / name if name else local, _join(temporary, name), check)
        check()  # the last point a cancel stops the job: the final step is not interrupted
        if destination.exists():
            if not overwrite:
                raise FileExistsError(f"{url} appeared while the job ran; set overwrite")
            if destination.is_dir() or local.is_dir():
                _remove(destination)  # a directory is replaced whole, never merged
        _commit(temporary, destination, names)
    finally:
        _remove(temporary)


def _commit(temporary: epath.Path, destination: epath.Path, names: list[str]) -> None:
    """The server-side copy onto the final names; a directory's partial copy is removed."""
    # epath has no copy that stays in the store (its rename checks for parent "directories"
    # that object stores do not have), so this uses the fsspec filesystem epath uses.
    fs = backend.fsspec_backend.fs(str(destination))
    try:
        for name in names:
            # One object each: S3 CopyObject, GCS rewrite. The name appears whole or not at all.
            fs.cp_file(str(_join(temporary, name)), str(_join(destination, name)))
    except BaseException:
        if names != [""]:
            log.warning("upload to %s failed while copying; removing what was copied", destination)
            _remove(destination)
        raise


def _join(path: epath.Path, name: str) -> epath.Path:
    return path / name if name else path


def _files(root: epath.Path) -> Iterator[epath.Path]:
    """Every object below `root`, depth first (epath's walk passes fsspec arguments s3fs
    refuses, so the tree is listed here)."""
    for child in sorted(root.iterdir(), key=str):
        if child.is_dir():
            yield from _files(child)
        else:
            yield child


def _copy(src: epath.Path | pathlib.Path, dst: epath.Path | pathlib.Path, check) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)  # a no-op on object stores
    with src.open("rb") as reader, dst.open("wb") as writer:
        while True:
            check()
            chunk = reader.read(_CHUNK)
            if not chunk:
                return
            writer.write(chunk)


def _remove(path: epath.Path) -> None:
    """Deletes an object or a prefix, when there is one."""
    if path.is_dir():
        path.rmtree(missing_ok=True)
    elif path.exists():
        path.unlink(missing_ok=True)
