"""`qmill quantize`: a checkpoint quantized in this process or on --server, its report printed.

The run is planned once (checkpoints/run/plan.py: the recipe read, the output format's scheme
and checks, every tensor's fate) before any work; --dry-run prints that plan, the run follows it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import pathlib
import sys
import threading
import time
from typing import Any

from rich.console import Console

from qmill.checkpoints.base import staging
from qmill.checkpoints.formats import registry as formats
from qmill.checkpoints.formats.compressed_tensors import writer as ct_writer
from qmill.checkpoints.lm import backends as lm_backends
from qmill.checkpoints.lm import calibration as lm_calibration
from qmill.checkpoints.lm import methods as lm_methods
from qmill.checkpoints.lm import plans as lm_plans
from qmill.checkpoints.run import calibration_coverage, pipeline
from qmill.checkpoints.run import plan as plan_lib
from qmill.cli import calibrated_lm, connect, lm_server, report, serving, static_activations
from qmill.client import credentials, recipes, retry


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    recipe = recipes.load(args.recipe)
    if args.group_size is not None:
        recipe = recipes.with_group_size(recipe, args.group_size)
    if calibrated_lm.calibrates(args):  # a mixture of experts' routers: never quantized
        recipe = lm_plans.keeping_routers(recipe)
    args.format = recipes.output_format(args.recipe, args.format)
    _check_output_folder(args.output)
    if args.dry_run and args.report_json:
        raise ValueError("--dry-run writes nothing; drop --report-json")
    started = time.monotonic()
    calibration = {} if args.dry_run else _calibration_kwargs(args)
    planned = _plan(args, recipe)
    static = static_activations.checked_scheme(args, planned.scheme)  # FP8, NVFP4: input scales
    lm = _language_model(args, recipe, out) if static is None else None
    if args.dry_run:
        summary = report.Summary(planned.rows(), 0.0, str(args.source), str(args.output), recipe)
        out.print(report.render(summary, args.table, plan=True), crop=False)
        return 0
    methods = _methods(args, planned, calibration)
    calibrated, remote = _calibrate_language_model(args, recipe, lm)
    inputs = static_activations.input_parts(args, recipe, planned, static)
    if remote is not None:
        calibration = remote.quantize_kwargs()
    folded = (calibrated or remote).folded if (calibrated or remote) else None
    rows = _run(args, planned, calibration, calibrated, inputs, folded, err)
    seconds = time.monotonic() - started
    rows, lm_report = _with_methods(rows, methods, lm, calibrated, remote)
    summary = report.Summary(
        rows,
        seconds,
        str(args.source),
        str(args.output),
        planned.recipe,
        disk_before=report.disk_bytes(args.source),
        disk_after=report.disk_bytes(args.output),  # what was written, stat'ed after commit
        calibration=lm_report,
    )
    if calibrated is not None or inputs:
        lm_calibration.discard(args.output)  # the output holds it now
    _print(args, summary, out)
    return 0


def _plan(args: argparse.Namespace, recipe: dict[str, Any]) -> plan_lib.Plan:
    """The run's plan (for --dry-run, with each tensor's bytes after predicted). A run on a
    server writing qmill's layout leaves each tensor's fate to it: no engine (jax) here."""
    engine = not args.server or args.dry_run
    if engine or args.format == formats.COMPRESSED_TENSORS:
        from qmill.checkpoints.run import embedded  # lazy: the engine (jax)

        # The plan reads the recipe with the engine: imported first as this process imports it
        # to quantize (embedded.load_engine: the collector paused, what it made frozen).
        embedded.load_engine(freeze=True)
    return plan_lib.make(
        args.source,
        args.output,
        recipe,
        args.format,
        overwrite=args.overwrite,
        engine=engine,
        dry_run=args.dry_run,
        untie=calibrated_lm.untie(args),  # --method hadamard: a tied head written untied
    )


def _with_methods(
    rows: list[pipeline.ReportRow], methods: dict[str, str], lm: Any, calibrated: Any, remote: Any
) -> tuple[list[pipeline.ReportRow], dict[str, Any] | None]:
    """The rows with the method that quantized each tensor (--calibration's, or a language
    model's GPTQ), and the language model's calibration report (None without one)."""
    if methods:
        rows = [dataclasses.replace(r, method=methods.get(r.path, "")) for r in rows]
    lm_report, gptqd = None, None
    if calibrated is not None:
        lm_report, gptqd = calibrated_lm.report_fields(lm, calibrated), calibrated.methods
    elif remote is not None:
        lm_report, gptqd = remote.report, remote.methods
    if gptqd is not None:
        rows = [dataclasses.replace(r, method=calibrated_lm.method_of(r, gptqd)) for r in rows]
    return rows, lm_report


def _run(
    args: argparse.Namespace,
    planned: plan_lib.Plan,
    calibration: dict[str, Any],
    calibrated: Any,
    inputs: dict[str, dict[str, Any]] | None,
    folded: Any,
    err: Console,
) -> list[pipeline.ReportRow]:
    """Runs the plan, retried (resuming) while a server is unavailable; the report's rows."""
    quiet = args.quiet or not err.is_terminal

    def attempt(restart: bool) -> list[pipeline.ReportRow]:
        backend = _backend(args)
        if calibrated is not None:
            backend = lm_backends.Precomputed(backend, calibrated)
        backend = static_activations.with_input_scales(backend, inputs)
        with backend, contextlib.nullcontext() if quiet else report.ProgressBar(err) as bar:
            return pipeline.run(
                planned,
                backend=retry.NoticeAnswers(_Calibrated(backend, calibration), answered),
                progress=bar,
                restart=restart,
                # The tensors only go out on the wire: read-only views of the file will do.
                mapped_reads=bool(args.server),
                # AWQ / SmoothQuant's folded norms and biases, in place of the source's.
                replaced=folded,
                on_resume=lambda done, total: print(
                    f"qmill: resumed: {done} of {total} tensors already written "
                    f"(in {args.output}{staging.PARTIAL_SUFFIX}; --restart starts over)",
                    file=sys.stderr,
                    flush=True,
                ),
            )

    # Only the first attempt may discard a partial output; retries resume it. A server that
    # never answered is more likely a wrong address than a restart: that fails at once.
    attempts = iter([args.restart])
    answered = threading.Event()
    return retry.call(
        lambda: attempt(next(attempts, False)),
        retry.Backoff(retries=max(0, args.retries) if args.server else 0),
        on_retry=lambda line: print(f"qmill: {line}", file=sys.stderr, flush=True),
        retry_if=lambda _: answered.is_set(),
    )


def _print(args: argparse.Namespace, summary: report.Summary, out: Console) -> None:
    """The report (or with --quiet its totals line), the JSON report, and the notes."""
    if args.quiet:
        out.print(report.totals_line(summary), markup=False, highlight=False, soft_wrap=True)
    else:
        out.print(report.render(summary, args.table), crop=False)
    if args.report_json:
        report.write_json(summary, args.report_json)
    for note in (
        _safetensors_folder_note(args.output),
        serving.qmill_layout_warning(args.output, args.recipe),
    ):
        if note:
            sys.stdout.flush()  # after the totals, not inside them
            print(note, file=sys.stderr)


def _backend(args: argparse.Namespace) -> pipeline.Backend:
    """The engine in-process, one server, or several (--server a,b or --streams)."""
    if not args.server:
        from qmill.checkpoints.run import embedded  # lazy: the engine (jax)

        # This process quantizes once and exits: what importing jax made is kept, frozen.
        embedded.load_engine(freeze=True)
        return embedded.EmbeddedClient()
    from qmill.client import fanout  # lazy: the gRPC client, for --server only

    if not fanout.is_fanout(args.server) and args.streams == 1:
        return connect.client(args)
    return fanout.FanoutClient(
        args.server,
        timeout=args.timeout,
        credentials=credentials.from_args(args),
        streams=args.streams,
        on_replica_lost=lambda address, e: print(
            f"qmill: replica {address} failed ({e.code}); its tensors go to the others",
            file=sys.stderr,
            flush=True,
        ),
    )


class _Calibrated:
    """A backend whose quantize calls carry the calibration (--calibration) as well."""

    def __init__(self, backend: Any, kwargs: dict[str, Any]) -> None:
        self._backend, self._kwargs = backend, kwargs

    def quantize(self, recipe: Any, tensors: Any, **kwargs: Any) -> Any:
        return self._backend.quantize(recipe, tensors, **kwargs, **self._kwargs)


def _methods(
    args: argparse.Namespace, planned: plan_lib.Plan, calibration: dict[str, Any]
) -> dict[str, str]:
    """Each quantized tensor's method, with the statistics in hand (--calibration STATS.npz):
    statistics that match no tensor the plan quantizes are refused, those that miss some say
    which."""
    if "calibration_stats" not in calibration:
        return {}
    what = f"--calibration {args.calibration}"
    methods, missing = calibration_coverage.methods_by_tensor(
        planned, calibration["calibration_stats"], what
    )
    if missing:
        print(calibration_coverage.missing_note(missing, len(methods)), file=sys.stderr)
    return methods


def _calibration_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """--calibration as the backend takes it: a calibration id for one server, the statistics
    themselves in-process."""
    if not args.calibration:
        return {}
    if args.server:
        from qmill.client import fanout  # lazy: the gRPC client, for --server only
        from qmill.proto.v1 import qmill_pb2 as pb

        if fanout.is_fanout(args.server) or args.streams != 1:
            raise ValueError("--calibration takes one --server (and --streams 1)")
        return {"static_ranges": pb.StaticRanges(calibration_id=args.calibration)}
    path = pathlib.Path(args.calibration)
    if path.suffix != ".npz" or not path.is_file():
        raise ValueError(
            f"--calibration {args.calibration}: without --server, give the statistics file "
            "(.npz) `qmill calibrate --stats-output` wrote; a calibration id needs its --server"
        )
    import numpy as np

    with np.load(path, allow_pickle=False) as f:
        stats = {k: f[k] for k in f.files}
    if args.format == formats.COMPRESSED_TENSORS:
        # An AWQ / SmoothQuant calibration is refused before any work.
        ct_writer.check_calibration(stats, f"--calibration {args.calibration}")
    return {"calibration_stats": stats}


def _check_output_folder(output: str) -> None:
    """Refuses `-o a/b/out` when a/b/ does not exist, as `cp` does: a mistyped path would
    otherwise leave a tree of folders nobody asked for."""
    parent = pathlib.Path(output).parent
    if not parent.is_dir():
        raise ValueError(
            f"the output's folder {parent} does not exist: create it first (mkdir -p {parent}) "
            "or choose another -o"
        )


def _safetensors_folder_note(output: str) -> str | None:
    """What to tell a user whose safetensors output became a folder (a name without
    .safetensors gets the Hugging Face layout, which shards need): None for a file, or for a
    Hugging Face model folder, which came out as the folder it went in."""
    folder = pathlib.Path(output)
    weights = sorted(p.name for p in folder.glob("*.safetensors")) if folder.is_dir() else []
    if not weights or (folder / "config.json").exists():
        return None
    shown = ", ".join(weights[:2]) + (", ..." if len(weights) > 2 else "")
    return (
        f"qmill: {output} is a folder ({shown}): a safetensors output named without "
        f".safetensors is written in the Hugging Face layout; -o {folder.name}.safetensors "
        "writes one file"
    )


def _calibrate_language_model(args: argparse.Namespace, recipe: dict, lm: Any) -> tuple:
    """(in-process calibration, server calibration) of a --method run, one of them None; both
    None without --method. Runs before the checkpoint pipeline, which then writes the output
    (the plan, made before, has refused what the output could not hold)."""
    if lm is None:
        return None, None
    if args.server:  # the server calibrates (lm_server.py)
        with connect.client(args) as client:
            return None, lm_server.calibrate(client, args, recipe, lm)
    return calibrated_lm.calibrate(args, recipe, lm), None


def _language_model(args: argparse.Namespace, recipe: dict, out: Console) -> Any:
    """The calibration request of a --method run (refused before any work when the model,
    the flags, the recipe or the memory estimate don't allow it), or None."""
    if not calibrated_lm.wanted(args):
        return None
    lm_calibration.model_config(args.source)  # an unsupported architecture: refused first
    if args.server:
        lm_server.check_server(args)
    lm = calibrated_lm.request(args)
    lm_calibration.check_request(args.source, lm, recipe)
    for line in calibrated_lm.check_memory(args, lm) + lm_methods.notices(lm.method, recipe):
        out.print(line, markup=False, highlight=False, soft_wrap=True)
    return lm
