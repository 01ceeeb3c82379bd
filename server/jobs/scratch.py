"""A job's scratch directory: where a job with object-store URLs reads and writes locally.

The pipeline (client/job.py) reads and writes the server's disk, so a job with a URL runs in
three steps: download the source into `<scratch>/<job id>/source/NAME`, quantize into
`<scratch>/<job id>/output/NAME` as any local job does (resumable through its .qmill-partial/),
upload the output (object_store.py). The paths depend only on the job id and the URLs' last
segments, so a job resumed by a restarted server finds its partial output and its downloaded
source where it left them: the source is downloaded to `source.tmp/` and renamed to `source/`
when complete, so a finished download is reused (same files, same fingerprint) and an
unfinished one started again. A job whose local output was complete (the server died while
uploading) writes it again, then uploads. The runner deletes the directory when the job ends,
however it ends; on start the server also deletes those of jobs no longer queued or running.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
from collections.abc import Callable, Iterable

from qmill.server import config as config_lib
from qmill.server.jobs import object_store, urls

# The scratch root's name in the server's data dir.
DIRECTORY = "job-staging"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagedJob:
    """The local paths a job's pipeline uses, and what is left to do after it."""

    job_id: str
    # Local paths given to quantize_checkpoint.
    source: str
    destination: str
    # The URL the local destination is uploaded to; None: the destination is local.
    upload_to: str | None = None
    # Whether the pipeline may replace an existing local destination. For a URL destination it
    # may: a local output there is this job's own, complete before a restart cut the upload, and
    # writing it again (a rare, bounded waste) keeps the runner's one path through the job.
    overwrite: bool = False

    def publish(self, *, overwrite: bool, check: Callable[[], None]) -> None:
        """Uploads the local output to the URL destination (nothing to do for a local one)."""
        if self.upload_to is not None:
            object_store.upload(
                pathlib.Path(self.destination),
                self.upload_to,
                tag=self.job_id,
                overwrite=overwrite,
                check=check,
            )


class Scratch:
    """`<data dir>/job-staging/`: one directory per job that has a URL."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = pathlib.Path(root)

    @classmethod
    def in_data_dir(cls, data_dir: str | None) -> Scratch:
        """`<data_dir>/job-staging` (None: the default data dir)."""
        return cls(os.path.join(data_dir or config_lib.default_data_dir(), DIRECTORY))

    def stage(
        self,
        job_id: str,
        source: str,
        destination: str,
        *,
        overwrite: bool,
        check: Callable[[], None],
    ) -> StagedJob:
        """The job's local paths; downloads a URL source first (unless done before)."""
        directory = self.root / job_id
        if urls.is_url(source):
            local = directory / "source" / _name(source)
            if not local.parent.is_dir():
                partial = directory / "source.tmp"
                shutil.rmtree(partial, ignore_errors=True)
                object_store.download(source, partial / local.name, check)
                os.rename(partial, local.parent)
            source = str(local)
        if not urls.is_url(destination):
            return StagedJob(
                job_id=job_id, source=source, destination=destination, overwrite=overwrite
            )
        output = directory / "output"
        output.mkdir(parents=True, exist_ok=True)
        local_destination = str(output / _name(destination))
        return StagedJob(
            job_id=job_id,
            source=source,
            destination=local_destination,
            upload_to=destination,
            overwrite=True,
        )

    def discard(self, job_id: str) -> None:
        """Deletes the job's scratch directory (there is none for a job of local paths)."""
        shutil.rmtree(self.root / job_id, ignore_errors=True)

    def sweep(self, keep: Iterable[str]) -> None:
        """Deletes the scratch directories of every job not in `keep` (left by a crash)."""
        if not self.root.is_dir():
            return
        kept = set(keep)
        for entry in self.root.iterdir():
            if entry.name not in kept:
                shutil.rmtree(entry, ignore_errors=True)


def _name(url: str) -> str:
    """The URL's last segment: the local copy keeps it, so the format is inferred the same
    way (an .npz suffix, an Orbax directory) and the job's report names the same files."""
    return url.rstrip("/").rsplit("/", 1)[-1]
