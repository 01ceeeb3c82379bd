"""The client's `qmill` commands: quantize, inspect, capabilities, and those of the other
client modules (upload, calibrate, export-odml, submit/jobs, admin).

The `qmill` dispatcher (qmill.cli) parses their flags with parsers.py and runs them here; `serve`
is the server's (qmill.server.command). The gRPC client is imported only by the commands that
talk to a server.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import pathlib
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console

from qmill import checkpoints
from qmill.checkpoints import (
    calibration_coverage,
    ct_writer,
    formats,
    hf_folder,
    lm_calibration,
    pipeline,
    quantization_config,
    staging,
)
from qmill.checkpoints import dtypes as checkpoint_dtypes
from qmill.checkpoints import errors as checkpoint_errors
from qmill.client import (
    calibrated_lm,
    credentials,
    lm_server,
    recipes,
    report,
    report_table,
    retry,
    serving,
    static_activations,
)

if TYPE_CHECKING:
    from qmill.client import client as client_lib

# Raised for what a user can fix: printed in one line, exit status 1.
USER_ERRORS = (
    checkpoint_errors.QmillError,
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
)


def user_message(error: Exception, args: argparse.Namespace) -> str:
    """The line printed for a user error. A run without --server has no RPC: its message speaks
    of the input, not of a gRPC status (the status name stays where a server answered)."""
    if isinstance(error, checkpoint_errors.QmillError) and not getattr(args, "server", None):
        return error.details
    return str(error)


def _dry_run(args: argparse.Namespace, recipe: dict, out: Console) -> int:
    if args.report_json:
        raise ValueError("--dry-run writes nothing; drop --report-json")
    formats.check_destination(
        args.source, args.output, overwrite=args.overwrite, output_format=args.format
    )
    from qmill.checkpoints import plan  # lazy: the plan comes from the engine (jax)

    rows = plan.plan_checkpoint(args.source, recipe)
    summary = report.Summary(rows, 0.0, str(args.source), str(args.output), recipe)
    out.print(report.render(summary, args.table, plan=True))
    return 0


def _backend(args: argparse.Namespace) -> pipeline.Backend:
    """The engine in-process, one server, or several (--server a,b or --streams)."""
    if not args.server:
        from qmill.checkpoints import embedded  # lazy: the engine (jax)

        # This process quantizes once and exits: what importing jax made is kept, frozen.
        embedded.load_engine(freeze=True)
        return embedded.EmbeddedClient()
    from qmill.client import fanout  # lazy: the gRPC client, for --server only

    if not fanout.is_fanout(args.server) and args.streams == 1:
        return _client(args)
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
        return {"calibration_stats": {k: f[k] for k in f.files}}


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


def _quantize(args: argparse.Namespace, out: Console, err: Console) -> int:
    recipe = recipes.load(args.recipe)
    if args.group_size is not None:
        recipe = recipes.with_group_size(recipe, args.group_size)
    args.format = recipes.output_format(args.recipe, args.format)
    _check_output_folder(args.output)
    static = static_activations.checked_scheme(args, recipe)  # FP8, NVFP4: input scales
    lm = _language_model(args, out) if static is None else None
    if args.dry_run:
        return _dry_run(args, recipe, out)
    started = time.monotonic()
    quiet = args.quiet or not err.is_terminal
    calibration = _calibration_kwargs(args)
    calibrated, remote = _calibrate_language_model(args, recipe, lm)
    inputs = static_activations.input_parts(args, recipe, static)
    if remote is not None:
        calibration = remote.quantize_kwargs()
    methods: dict[str, str] = {}  # with statistics in hand: each quantized tensor's method
    if "calibration_stats" in calibration:
        what = f"--calibration {args.calibration}"
        if args.format == formats.COMPRESSED_TENSORS:
            # An AWQ / SmoothQuant calibration is refused before any work.
            ct_writer.check_calibration(calibration["calibration_stats"], what)
        # Statistics that match no tensor are refused; those that miss some say which.
        methods, missing = calibration_coverage.methods_by_tensor(
            args.source, recipe, calibration["calibration_stats"], what
        )
        if missing:
            print(calibration_coverage.missing_note(missing, len(methods)), file=sys.stderr)

    def attempt(restart: bool) -> list[pipeline.ReportRow]:
        backend = _backend(args)
        if calibrated is not None:
            backend = lm_calibration.Precomputed(backend, calibrated)
        backend = static_activations.with_input_scales(backend, inputs)
        with backend, contextlib.nullcontext() if quiet else report.ProgressBar(err) as bar:
            return pipeline.quantize_checkpoint(
                args.source,
                args.output,
                recipe,
                backend=retry.NoticeAnswers(_Calibrated(backend, calibration), answered),
                output_format=args.format,
                overwrite=args.overwrite,
                progress=bar,
                restart=restart,
                # The tensors only go out on the wire: read-only views of the file will do.
                mapped_reads=bool(args.server),
                # AWQ / SmoothQuant's folded norms and biases, in place of the source's.
                replaced=(calibrated or remote).folded if (calibrated or remote) else None,
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
    rows = retry.call(
        lambda: attempt(next(attempts, False)),
        retry.Backoff(retries=max(0, args.retries) if args.server else 0),
        on_retry=lambda line: print(f"qmill: {line}", file=sys.stderr, flush=True),
        retry_if=lambda _: answered.is_set(),
    )
    seconds = time.monotonic() - started
    if methods:
        rows = [dataclasses.replace(r, method=methods.get(r.path, "")) for r in rows]
    lm_report, gptqd = None, None
    if calibrated is not None:
        lm_report, gptqd = calibrated_lm.report_fields(lm, calibrated), calibrated.methods
    elif remote is not None:
        lm_report, gptqd = remote.report, remote.methods
    if gptqd is not None:
        rows = [dataclasses.replace(r, method=calibrated_lm.method_of(r, gptqd)) for r in rows]
    summary = report.Summary(
        rows,
        seconds,
        str(args.source),
        str(args.output),
        pipeline.with_default_convention(recipe, _source_format(args.source)),
        disk_before=report.disk_bytes(args.source),
        disk_after=report.disk_bytes(args.output),  # what was written, stat'ed after commit
        calibration=lm_report,
    )
    if calibrated is not None or inputs:
        lm_calibration.discard(args.output)  # the output holds it now
    if args.quiet:
        out.print(report.totals_line(summary), markup=False, highlight=False, soft_wrap=True)
    else:
        out.print(report.render(summary, args.table))
    if args.report_json:
        report.write_json(summary, args.report_json)
    for note in (
        _safetensors_folder_note(args.output),
        serving.qmill_layout_warning(args.output, args.recipe),
    ):
        if note:
            sys.stdout.flush()  # after the totals, not inside them
            print(note, file=sys.stderr)
    return 0


def _calibrate_language_model(args: argparse.Namespace, recipe: dict, lm: Any) -> tuple:
    """(in-process calibration, server calibration) of a --method run, one of them None; both
    None without --method. Runs before the checkpoint pipeline, which then writes the output."""
    if lm is None:
        return None, None
    formats.check_destination(
        args.source, args.output, overwrite=args.overwrite, output_format=args.format
    )
    if args.server:  # the server calibrates (lm_server.py)
        with _client(args) as client:
            return None, lm_server.calibrate(client, args, recipe, lm)
    return calibrated_lm.calibrate(args, recipe, lm), None


def _language_model(args: argparse.Namespace, out: Console) -> Any:
    """The calibration request of a --method run (refused before any work when the model,
    the flags or the memory estimate don't allow it), or None."""
    if not calibrated_lm.wanted(args):
        return None
    lm_calibration.model_config(args.source)  # an unsupported architecture: refused first
    if args.server:
        lm_server.check_server(args)
    lm = calibrated_lm.request(args)
    for line in calibrated_lm.check_memory(args, lm):
        out.print(line, markup=False, highlight=False, soft_wrap=True)
    return lm


def _source_format(path: str) -> str:
    with checkpoints.open_source(path) as source:
        return source.format


def _inspect(args: argparse.Namespace, out: Console) -> int:
    with checkpoints.open_source(args.checkpoint) as source:
        entries = source.entries()
        rows = [
            # As stored: 4-bit codes take half a byte each on disk (and on the wire).
            (
                e.path,
                e.dtype.name,
                "×".join(map(str, e.shape)) or "scalar",
                f"{checkpoint_dtypes.packed_nbytes(e.dtype, e.shape):,}",
            )
            for e in entries
        ]
        columns = [
            report_table.Column("dtype"),
            report_table.Column("shape"),
            report_table.Column("bytes", "right"),
        ]
        title = f"{args.checkpoint} ({source.format})"
        table = report_table.PathTable(
            title, columns, rows, whole=True, box=box.SQUARE, pad_edge=True
        )
        folder = _folder_lines(source) if isinstance(source, hf_folder.HfFolderSource) else []
    out.print(table)
    for text in folder:
        out.print(text, markup=False, highlight=False, soft_wrap=True)
    # A quantized leaf P is stored as P/array/qvalue (+ scale, zero_point).
    leaves = [e for e in entries if e.path.endswith(("/array/qvalue", ".array.qvalue"))]
    dtypes = sorted({e.dtype.name for e in leaves})
    quantized = f"; {len(leaves)} quantized leaves ({', '.join(dtypes)})" if leaves else ""
    # compressed-tensors stores a quantized weight M.weight as M.weight_scale and its codes.
    compressed = sum(e.path.endswith(".weight_scale") for e in entries)
    quantized += f"; {compressed} compressed-tensors weights" if compressed else ""
    stored = sum(checkpoint_dtypes.packed_nbytes(e.dtype, e.shape) for e in entries)
    out.print(
        f"{len(entries)} tensors, {stored:,} bytes{quantized}",
        markup=False,
        highlight=False,
    )
    return 0


def _folder_lines(source: hf_folder.HfFolderSource) -> list[str]:
    """What a Hugging Face model folder holds besides its tensors."""
    config = source.config
    architectures = ", ".join(config.get("architectures") or []) or "-"
    title = (
        f"Hugging Face model folder {source.folder}: model_type "
        f"{config.get('model_type', '-')}, architectures {architectures}"
        if source.has_config
        else f"folder {source.folder}: no config.json (no model transformers or vLLM can load)"
    )
    lines = [
        title,
        "weights: "
        + ", ".join(f"{p.name} ({p.stat().st_size:,} bytes)" for p in source.weight_files()),
    ]
    copied, left_out = source.other_files()
    names = ", ".join(str(p) for p in copied)
    lines.append(f"other files ({len(copied)}, copied as they are when quantized): {names}")
    if left_out:
        lines.append(
            "weights in other formats (left out when quantized): "
            + ", ".join(str(p) for p in left_out)
        )
    if source.has_config:  # else the tensors' names say it (the last line of inspect)
        lines.append(quantization_config.describe(config))
    return lines


def _client(args: argparse.Namespace) -> client_lib.Client:
    """The one Client of a command that talks to `--server`, with its connection flags."""
    from qmill.client import client as client_lib  # lazy: see add_command

    return client_lib.Client(
        args.server,
        credentials=credentials.from_args(args),
        timeout=getattr(args, "timeout", None),
    )


def _capabilities(client: client_lib.Client, out: Console) -> int:
    caps = client.capabilities()
    device = caps.device_kind
    if caps.device_description.lower() not in ("", device.lower()):  # not "on cpu: cpu"
        device += f": {caps.device_description}"
    out.print(f"qmill {caps.qmill_version} (jax {caps.jax_version}) on {device}")
    out.print("qtypes: " + ", ".join(caps.qtypes))
    out.print("calibration methods: " + ", ".join(caps.calibration_methods))
    out.print(f"max tensor bytes: {caps.max_tensor_bytes:,}")
    for m in caps.models:  # for `qmill calibrate --model NAME --config '{...}'`
        fields = ", ".join(f"{f.name}: {f.type} = {f.default_json}" for f in m.config_fields)
        out.print(f"model {m.name} ({m.origin}): {m.description} {{{fields}}}", markup=False)
    return 0


def run(args: argparse.Namespace, out: Console | None = None, err: Console | None = None) -> int:
    """Runs the client command `args.command` (printing to `out` and `err`, stdout and stderr by
    default); returns the exit status."""
    out = out or Console()
    err = err or Console(stderr=True)

    def line(text: str) -> None:
        out.print(text, markup=False, highlight=False, soft_wrap=True)

    if args.command == "quantize":
        return _quantize(args, out, err)
    if args.command == "inspect":
        return _inspect(args, out)
    # The gRPC client's commands (and export-program's model loading): imported on use.
    from qmill.client import admin, calibrate, export_odml, jobs, programs, uploads

    if args.command == "export-program":
        return programs.run_local(args, line)
    if args.command == "calibrate" and not args.server:
        return calibrate.run_local(args, line)
    modules = {
        "export-odml": export_odml,
        "admin": admin,
        "upload": uploads,
        "calibrate": calibrate,
        "submit": jobs,
        "jobs": jobs,
    }
    with _client(args) as client:
        if args.command == "capabilities":
            return _capabilities(client, out)
        return modules[args.command].run_command(client, args, line)
