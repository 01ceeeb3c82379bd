"""The Jobs service: a thin adapter from RPCs to the job store and runner.

Jobs are visible to their tenant only: another tenant's job id gets NOT_FOUND, the same answer
as an id that does not exist. Paths are the server's own filesystem (local or mounted), confined
to the tenant's directory under --jobs-root, or object-store URLs (gs://, s3://) confined to the
tenant's prefix under --jobs-url-root (paths.py has the rules, scratch.py how such jobs run).
"""

from __future__ import annotations

import asyncio
import logging
import os
import urllib.parse

import grpc

from qmill.checkpoints.formats.compressed_tensors import activations as ct_activations
from qmill.checkpoints.lm import plans as lm_plans
from qmill.proto import recipe as recipe_proto
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc
from qmill.server import auth, codec, errors, limits
from qmill.server import config as config_lib
from qmill.server import metrics as metrics_lib
from qmill.server.jobs import language_model as lm_jobs
from qmill.server.jobs import object_store, postgres_store, sqlite_store, urls
from qmill.server.jobs import paths as paths_lib
from qmill.server.jobs import peers as peers_lib
from qmill.server.jobs import runner as runner_lib
from qmill.server.jobs import scratch as scratch_lib
from qmill.server.jobs import store as store_lib

log = logging.getLogger(__name__)

# How often WatchJob looks at its job; changes in between are coalesced into one event.
WATCH_POLL_SECONDS = 0.1
FORMATS = ("", "orbax", "safetensors", "npz", "compressed-tensors")


class JobsServicer(pb_grpc.JobsServicer):
    # The store's calls run in a thread: each is short, but a PostgreSQL store waits on the
    # network, and on a database that is down, which must not stop the event loop.

    def __init__(self, runner: runner_lib.JobRunner) -> None:
        self._runner = runner
        self._store = runner.store
        self._paths = runner.paths

    @errors.unary
    async def SubmitJob(self, request: pb.SubmitJobRequest, context) -> pb.Job:
        tenant = auth.current_principal().tenant
        # Confinement first, before anything about a path is told back (e.g. whether it exists).
        source = self._paths.resolve(tenant, request.source, "source")
        destination = self._paths.resolve(tenant, request.destination, "destination")
        # A repeated request_id answers with its job before any check: the job may have written
        # the destination since the first submit.
        existing = await asyncio.to_thread(self._store.find, tenant, request.request_id)
        if existing is not None:
            return _same_job(existing, request.request_id, source, destination).to_proto()
        for path in (source, destination):
            if urls.is_url(path):
                object_store.require_filesystem(path)  # before asking the store anything
        if not await _exists(source, follow=True):
            where = "" if urls.is_url(source) else " on the server"
            raise ValueError(f"source {source} does not exist{where}")
        self._paths.check_job(tenant, source, destination)  # symlinks inside a source directory
        if request.output_format not in FORMATS:
            raise ValueError(
                f"output_format {request.output_format!r} is not one of {', '.join(FORMATS[1:])} "
                "(or empty for the source's format)"
            )
        if not request.recipe.rules:
            raise ValueError("the recipe has no rules; send at least one (e.g. qtype int8)")
        # The check QuantizeParams makes of its recipe: a bad rule or qtype (int99) is refused
        # now, with the engine's message, instead of failing the job later.
        codec.recipe_from_proto(request.recipe)
        recipe = recipe_proto.to_mapping(request.recipe)
        ct_activations.refuse_uncalibrated(recipe, request.output_format, "a job")
        if recipe["convention"] == "auto":
            # As `qmill quantize` does: no convention → the source format's (job.py fills it).
            del recipe["convention"]
        language_model = b""
        if request.HasField("language_model"):
            # As `qmill quantize --method` does: a mixture of experts' routers stay in float.
            recipe = lm_plans.keeping_routers(recipe)
            # A language model calibrated first: its architecture, tensors and token ids are
            # checked now (reading config.json and the weights' headers), not in the job.
            language_model = await asyncio.to_thread(
                lm_jobs.check_submit, request.language_model, source, recipe
            )
        if not request.overwrite and await _exists(destination, follow=False):
            raise errors.AlreadyExists(
                f"destination {destination} already exists; set overwrite to replace it"
            )
        record, created = await asyncio.to_thread(
            self._store.create,
            tenant=tenant,
            request_id=request.request_id,
            source=source,
            destination=destination,
            recipe=recipe,
            output_format=request.output_format,
            overwrite=request.overwrite,
            language_model=language_model,
        )
        if created:
            self._runner.submit(record.job_id)
        return _same_job(record, request.request_id, source, destination).to_proto()

    @errors.unary
    async def GetJob(self, request: pb.GetJobRequest, context) -> pb.Job:
        return (await self._owned(request.job_id)).to_proto()

    @errors.streaming
    async def WatchJob(self, request: pb.GetJobRequest, context):
        last = None
        while True:
            record = await self._owned(request.job_id)
            seen = (record.state, record.tensors_done, record.tensors_total, record.message)
            if seen != last:
                last = seen
                yield pb.JobEvent(job=record.to_proto(), message=record.message)
            if record.state in store_lib.FINAL:
                return
            await asyncio.sleep(WATCH_POLL_SECONDS)

    @errors.unary
    async def ListJobs(self, request: pb.ListJobsRequest, context) -> pb.ListJobsResponse:
        tenant: str | None = auth.current_principal().tenant
        if request.all_tenants:
            auth.require_admin("listing every tenant's jobs (all_tenants)")
            tenant = None
        records = await asyncio.to_thread(
            self._store.list, tenant=tenant, states=list(request.states)
        )
        return pb.ListJobsResponse(jobs=[r.to_proto() for r in records])

    @errors.unary
    async def CancelJob(self, request: pb.GetJobRequest, context) -> pb.Job:
        await self._owned(request.job_id)
        return (await asyncio.to_thread(self._runner.cancel, request.job_id)).to_proto()

    async def _owned(self, job_id: str) -> store_lib.JobRecord:
        if not job_id:
            raise ValueError("job_id is empty; pass the id SubmitJob returned")
        record = await asyncio.to_thread(self._store.get, job_id)
        if record is None:
            raise errors.NotFound(f"job {job_id} not found")
        auth.require_owner(record.tenant, f"job {job_id}")
        return record


async def _exists(path: str, *, follow: bool) -> bool:
    """Whether something is at a job path (`follow`: a dangling symlink is nothing). An object
    store is asked off the event loop: a request takes milliseconds to seconds."""
    if urls.is_url(path):
        return await asyncio.to_thread(object_store.exists, path)
    return os.path.exists(path) if follow else os.path.lexists(path)


def _same_job(
    record: store_lib.JobRecord, request_id: str, source: str, destination: str
) -> store_lib.JobRecord:
    """`record`, when it is the job these paths describe; a reused request_id otherwise."""
    if (record.source, record.destination) != (source, destination):
        raise errors.AlreadyExists(
            f"request_id {request_id!r} already names job {record.job_id} "
            f"({record.source} → {record.destination}); use a new request_id"
        )
    return record


def jobs_db_path(config: config_lib.ServerConfig) -> str:
    """Where jobs are kept, in words for the log: the SQLite file, or the PostgreSQL database's
    host and name (never its URL: that holds the password)."""
    if store_lib.is_database_url(config.jobs_db):
        url = urllib.parse.urlsplit(config.jobs_db)
        return f"the PostgreSQL database {url.hostname}:{url.port or 5432}{url.path}"
    return config.jobs_db or os.path.join(config.data_dir, "jobs.sqlite3")


def open_store(config: config_lib.ServerConfig) -> store_lib.JobStore:
    """The store --jobs-db names: a PostgreSQL database (postgresql://...), shared by every
    replica given the same URL, or a SQLite file (default: jobs.sqlite3 in the data dir)."""
    if store_lib.is_database_url(config.jobs_db):
        return postgres_store.PostgresJobStore(config.jobs_db)
    return sqlite_store.SqliteJobStore(jobs_db_path(config))


def add_to_server(
    server: grpc.aio.Server,
    config: config_lib.ServerConfig,
    metrics: metrics_lib.Metrics,
    job_peer_backends: peers_lib.JobPeerBackends | None = None,
    *,
    limiter: limits.ByteLimiter | None = None,
) -> runner_lib.JobRunner:
    """Registers the Jobs service; returns its runner, for the server to start and stop. With
    `limiter`, jobs count their tensors under the server's in-flight limit as streams do."""
    policy = paths_lib.PathPolicy.from_config(config)
    log.info("jobs: %s", policy.describe())
    store = open_store(config)
    log.info("jobs kept in %s", "PostgreSQL, shared" if store.shared else "SQLite, this server's")
    new_backend = peers_lib.backend_factory(config, job_peer_backends)
    if config.job_peers:
        log.info("jobs: tensors spread over --job-peers %s", config.job_peers)
    scratch = scratch_lib.Scratch.in_data_dir(config.data_dir)
    # Scratch of jobs that ended while no runner could delete it (a crash at the wrong moment).
    scratch.sweep(keep=[r.job_id for r in store.list(tenant=None, states=list(store_lib.ACTIVE))])
    runner = runner_lib.JobRunner(
        store,
        paths=policy,
        on_change=lambda: metrics.set_jobs_by_state(store.counts()),
        new_backend=new_backend,
        scratch=scratch,
        max_tensor_bytes=config.max_tensor_bytes,
        limiter=limiter,
        lease_seconds=config.job_lease_seconds,
        tenant_limit=config.max_tenant_jobs,
    )
    pb_grpc.add_JobsServicer_to_server(JobsServicer(runner), server)
    return runner
