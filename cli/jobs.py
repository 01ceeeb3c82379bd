"""`qmill submit` and `qmill jobs list|watch|cancel`: batch jobs on a server (the Jobs service
of the client, client/jobs.py), with --method gptq's language-model calibration (lm_jobs).
"""

from __future__ import annotations

import sys
from typing import Any

from qmill.cli import calibrated_lm, lm_jobs
from qmill.client import credentials as credentials_lib
from qmill.client import errors, recipes
from qmill.client.jobs import Jobs, state_name
from qmill.client.service_client import ServiceClient
from qmill.proto.v1 import qmill_pb2 as pb


def describe(job: pb.Job) -> str:
    """One line for a job: id, state, progress, paths, then the error of a failed one or the
    latest message of any other (e.g. how a finished job's tensors were shared by --job-peers)."""
    line = (
        f"{job.job_id}  {state_name(job.state):<9}  {job.tensors_done}/{job.tensors_total} "
        f"tensors  {job.source} → {job.destination}"
    )
    if job.error:
        return f"{line}  error: {job.error}"
    return f"{line}  ({job.message})" if job.message else line


def add_commands(sub: Any, recipe_help: str) -> None:
    """Adds the `submit` and `jobs` commands to the CLI's subparsers."""
    s = sub.add_parser(
        "submit",
        help="run a quantize job on a server (server-side paths)",
        epilog=lm_jobs.SUBMIT_HELP,
    )
    s.add_argument("source", help="checkpoint path on the server")
    s.add_argument("destination", help="where the server writes the quantized checkpoint")
    s.add_argument("--server", required=True, help="HOST:PORT")
    s.add_argument("--recipe", default="int8", help=recipe_help)
    s.add_argument(
        "--format",
        choices=("orbax", "safetensors", "npz", "compressed-tensors"),
        help="output format (a compressed-tensors scheme --recipe implies compressed-tensors)",
    )
    s.add_argument(
        "--group-size",
        type=int,
        help="input features per scale in the recipe's grouped rules (W4A16's default 128)",
    )
    s.add_argument("--overwrite", action="store_true", help="replace an existing destination")
    s.add_argument("--watch", action="store_true", help="follow the job until it ends")
    calibrated_lm.add_arguments(s)
    credentials_lib.add_arguments(s)  # --request-id doubles as the job's idempotency key

    j = sub.add_parser("jobs", help="list, watch or cancel jobs on a server")
    jsub = j.add_subparsers(dest="jobs_command", required=True)
    ls = jsub.add_parser("list", help="this tenant's jobs, oldest first")
    ls.add_argument("--all-tenants", action="store_true", help="every tenant's (admin token)")
    for name, text in (("watch", "follow a job until it ends"), ("cancel", "cancel a job")):
        p = jsub.add_parser(name, help=text)
        p.add_argument("job_id")
    for p in jsub.choices.values():
        p.add_argument("--server", required=True, help="HOST:PORT")
        credentials_lib.add_arguments(p)


def run_command(client: ServiceClient, args: Any, print_line: Any) -> int:
    """Runs `submit` or `jobs ...`; returns the exit code (1 when a watched job did not succeed)."""
    jobs = client.jobs
    if args.command == "submit":
        recipe = recipes.load(args.recipe)
        if args.group_size is not None:
            recipe = recipes.with_group_size(recipe, args.group_size)
        job = jobs.submit(
            args.source,
            args.destination,
            recipe,
            request_id=args.request_id or "",
            output_format=recipes.output_format(args.recipe, args.format) or "",
            overwrite=args.overwrite,
            language_model=lm_jobs.from_args(args, print_line),
        )
        print_line(describe(job))
        return _watch(jobs, job.job_id, print_line) if args.watch else 0
    if args.jobs_command == "list":
        for job in jobs.list(all_tenants=args.all_tenants):
            print_line(describe(job))
        return 0
    if args.jobs_command == "cancel":
        job = jobs.cancel(args.job_id)
        print_line(describe(job))
        if job.state in (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED):
            # Cancelling changed nothing: said, not left to a state a reader may skim. Still
            # exit 0, as for a job cancelled twice: the job is not running either way.
            print(
                f"qmill: job {job.job_id} had already {state_name(job.state)}: nothing was "
                "cancelled",
                file=sys.stderr,
            )
        return 0
    return _watch(jobs, args.job_id, print_line)


def _watch(jobs: Jobs, job_id: str, print_line: Any) -> int:
    job = None

    def interrupted(line: str) -> None:
        print(f"qmill: {line}", file=sys.stderr, flush=True)

    for event in jobs.watch(job_id, on_retry=interrupted):
        job = event.job
        print_line(
            f"{state_name(job.state)}: {event.message} "
            f"({job.tensors_done}/{job.tensors_total} tensors, {job.bytes_done:,} bytes)"
        )
    if job is None or job.state != pb.JOB_STATE_SUCCEEDED:
        error = f": {job.error}" if job is not None and job.error else ""
        raise errors.QmillError(
            "FAILED_PRECONDITION" if job is None else state_name(job.state).upper(),
            f"job {job_id} did not succeed{error}",
        )
    return 0
