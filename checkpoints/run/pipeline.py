"""The main job: read a checkpoint tensor by tensor, quantize, write the quantized checkpoint.

The run follows its plan (plan.py), made before any work: tensors the plan copies (integer and
bool dtypes) or keeps are written from the source without a round trip; the others go to the
backend (a server or the embedded engine) and come back quantized (or kept, where a server
decides). The output appears under its final name only when every tensor was written; until
then finished tensors are kept beside it (`<destination>.qmill-partial/`) so an interrupted run
resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from qmill.checkpoints.base import errors, protocols, staging
from qmill.checkpoints.formats import registry as formats
from qmill.checkpoints.run import in_order
from qmill.checkpoints.run import outcome as outcome_lib
from qmill.checkpoints.run import plan as plan_lib
from qmill.checkpoints.run import replaced as replaced_lib
from qmill.checkpoints.run import rows as rows_lib
from qmill.checkpoints.run.plan import QUANTIZABLE as QUANTIZABLE
from qmill.checkpoints.run.plan import with_default_convention as with_default_convention
from qmill.checkpoints.run.rows import ReportRow as ReportRow


class Backend(Protocol):
    def quantize(
        self, recipe: dict[str, Any], tensors: Any, **kwargs: Any
    ) -> Iterator[outcome_lib.TensorOutcome]: ...


class Progress(Protocol):
    def start(self, total_bytes: int, total_tensors: int) -> None: ...
    def advance(self, nbytes: int) -> None: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """How a run goes, beside its plan (see quantize_checkpoint's arguments)."""

    progress: Progress | None = None
    restart: bool = False
    check: Callable[[], None] | None = None
    max_tensor_bytes: int | None = None
    mapped_reads: bool = False
    in_place: bool = True
    on_resume: Callable[[int, int], None] | None = None
    # Tensor name -> a loader of the array read in place of the source's (same dtype and shape):
    # the norms and biases a language model's AWQ / SmoothQuant folded its scales into
    # (lm/calibration.py). They are part of the partial output's fingerprint.
    replaced: Mapping[str, Callable[[], np.ndarray]] | None = None


def quantize_checkpoint(
    source_path: str | os.PathLike,
    destination: str | os.PathLike,
    recipe: dict[str, Any],
    *,
    backend: Backend,
    output_format: str | None = None,
    overwrite: bool = False,
    engine: bool = False,
    untie: tuple[str, str] | None = None,
    **options: Any,
) -> list[ReportRow]:
    """Quantizes a checkpoint; returns one report row per tensor, in checkpoint order.

    Plans the run (plan.make; `engine`: each tensor's fate decided here, else by the backend,
    compressed-tensors always here) and runs it (`run`, whose `options` these are).

    Resumable: every tensor the backend finishes is kept in `<destination>.qmill-partial/`
    (staging.PartialOutput), so calling again with the same arguments after an interruption
    sends only the tensors not yet finished. The checkpoint is written in checkpoint order (as
    tensors finish, in_order.InOrder) from the results, the partial output and the source, so it
    is byte for byte the one an uninterrupted run writes, and appears under its final name only
    when complete. Where the format allows (formats.writes_in_place) and `in_place` is left on,
    a result whose turn has come is written once, into the output's data kept in the partial
    output; a job whose partial output is copied elsewhere part by part turns it off.

    `check`, when given, is called before each tensor is read, while sending and while writing;
    whatever it raises stops the job (a server's job runner cancels this way: raised before the
    checkpoint is committed, nothing appears at `destination`).

    `max_tensor_bytes`, when given, refuses the checkpoint before any tensor is read if one
    tensor is larger (a server's jobs obey its --max-tensor-bytes as its streams do).

    `mapped_reads`: a safetensors source hands out read-only views of the file's pages
    (SafetensorsSource.mapped) instead of copies, for a backend that only sends the bytes on (a
    server); the engine in this process wants buffers of its own.

    `replaced`: tensor name -> a loader of the array read in place of the source's (Options).
    `untie`: (head, embedding) of a Hugging Face folder's tied head, written as a tensor of its
    own (plan.make), from `replaced`.

    Raises:
        FileExistsError: `destination` exists and `overwrite` is False.
        staging.FingerprintMismatch: a partial output made with another recipe, source or
            format is in the way; `restart=True` discards it.
        ValueError: the plan refuses the source or recipe (plan.make), or a tensor is larger
            than `max_tensor_bytes`.
        errors.OutputError: the output's disk is full, read-only or not writable; the
            finished tensors stay in the partial output.
    """
    planning = {"overwrite": overwrite, "engine": engine, "untie": untie}
    with plan_lib.opened(source_path, destination, recipe, output_format, **planning) as opened:
        return _run_opened(*opened, backend, Options(**options))


def run(plan: plan_lib.Plan, *, backend: Backend, **options: Any) -> list[ReportRow]:
    """Runs `plan` (plan.make) with `backend`; quantize_checkpoint says how and what it raises.

    Raises:
        ValueError: the source's tensors are no longer those the plan was made for.
    """
    with plan.opened() as checkpoint:
        planned = [(e.path, e.dtype, tuple(e.shape)) for e in checkpoint.entries()]
        if planned != [(t.path, t.entry.dtype, tuple(t.entry.shape)) for t in plan.tensors]:
            raise ValueError(f"{plan.source} changed since the run was planned; run it again")
        return _run_opened(plan, checkpoint, backend, Options(**options))


def _run_opened(
    plan: plan_lib.Plan,
    checkpoint: protocols.TensorSource,
    backend: Backend,
    options: Options,
) -> list[ReportRow]:
    dest = pathlib.Path(plan.destination)
    if options.mapped_reads and hasattr(checkpoint, "mapped"):
        checkpoint.mapped = True  # a safetensors source maps its tensors instead of reading
    _check_sizes(checkpoint.entries(), options.max_tensor_bytes)
    # What the tensors are read from; the writer still takes the source's own layout.
    reads = replaced_lib.ReplacedSource(checkpoint, options.replaced) if options.replaced else None
    fingerprint = _fingerprint(plan, checkpoint.entries(), reads)
    # The tensors as the engine quantizes them (compressed-tensors FP8_BLOCK: ragged blocks
    # padded); the writer works from the source as it is.
    source = plan.view(reads or checkpoint)
    entries = source.entries()
    # A full disk or read-only output says what failed and what is kept for resuming.
    opened: list[staging.PartialOutput] = []
    kept = dest.absolute().with_name(dest.name + staging.PARTIAL_SUFFIX)
    with errors.output_failures(
        dest, plan.source, kept, lambda: len(opened[0].completed) if opened else 0
    ):
        partial = staging.PartialOutput(dest, fingerprint, restart=options.restart)
        opened.append(partial)
        try:
            in_place = options.in_place and formats.writes_in_place(plan.format)
            if not in_place and partial.written:
                raise ValueError(
                    f"{kept} was written in place, which this run does not do; pass "
                    "--restart to discard it"
                )
            with _writer(plan, checkpoint, partial if in_place else None) as writer:
                rows = _write(plan, source, entries, backend, partial, writer, options, in_place)
        except BaseException:
            if not partial.completed:
                partial.discard()  # nothing finished: nothing to keep (an in-place start)
            raise
        finally:
            partial.close()
    partial.discard()
    return [plan_lib.stored_row(plan.by_path[e.path], rows[e.path]) for e in entries]


def _writer(
    plan: plan_lib.Plan, checkpoint: protocols.TensorSource, partial: staging.PartialOutput | None
) -> protocols.CheckpointWriter:
    # The recipe goes into a Hugging Face folder's config.json (quantization_config).
    return formats.create_writer(
        plan.destination,
        plan.format,
        like=checkpoint,
        overwrite=plan.overwrite,
        recipe=plan.quantize_recipe,
        in_place=partial.in_place() if partial is not None else None,
        scheme=plan.scheme,
        global_scales=plan.global_scales,
    )


def _write(
    plan: plan_lib.Plan,
    source: protocols.TensorSource,
    entries: list[protocols.TensorEntry],
    backend: Backend,
    partial: staging.PartialOutput,
    writer: Any,
    options: Options,
    in_place: bool,
) -> dict[str, ReportRow]:
    def sent(path: str) -> bool:
        return plan.by_path[path].sent

    ordered = in_order.InOrder(source, entries, partial, writer, options.check, in_place, sent)
    done = sum(e.path in partial.completed for e in entries)
    if done and options.on_resume is not None:
        options.on_resume(done, len(entries))  # (tensors already written, all)
    return _run(plan, source, entries, backend, partial, options.progress, ordered)


def _run(
    plan: plan_lib.Plan,
    source: protocols.TensorSource,
    entries: list[protocols.TensorEntry],
    backend: Backend,
    partial: staging.PartialOutput,
    progress: Progress | None,
    ordered: in_order.InOrder,
) -> dict[str, ReportRow]:
    """Sends the tensors not finished yet, writing the checkpoint as far as finished tensors in
    entry order allow; returns every tensor's report row."""
    check = ordered.check
    ordered.advance()  # what a resumed run finished before
    rows: dict[str, ReportRow] = {}
    if progress is not None:
        progress.start(sum(e.nbytes for e in entries), len(entries))
    index = {e.path: i for i, e in enumerate(entries)}
    to_send = []
    for entry in entries:
        planned = plan.by_path[entry.path]
        if not planned.sent:
            rows[entry.path] = rows_lib.kept_row(entry, planned.reason)
        elif entry.path in partial.completed:
            info = partial.completed[entry.path]["info"]
            rows[entry.path] = ReportRow(**rows_lib.row_fields(info))
        else:
            to_send.append(entry)
            continue
        if progress is not None:
            progress.advance(entry.nbytes)

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        for entry in to_send:
            if check is not None:
                check()
            yield entry.path, source.read(entry.path)

    by_path = {e.path: e for e in to_send}
    for outcome in backend.quantize(plan.quantize_recipe, tensors()):
        entry = by_path[outcome.path]
        if outcome.quantized:
            row = rows_lib.quantized_row(entry, outcome)
            parts = outcome.parts
            ordered.check_parts(entry.path, parts)  # before it is kept for resuming
        else:
            # A kept tensor is the source's own: the checkpoint is written from the source.
            row = rows_lib.kept_row(entry, outcome.reason)
            parts = {}
        ordered.take(index[entry.path], entry.path, parts, dataclasses.asdict(row))
        rows[entry.path] = row
        if progress is not None:
            progress.advance(entry.nbytes)
    missing = [e.path for e in to_send if e.path not in rows]
    if missing:
        raise RuntimeError(f"no result for {len(missing)} tensor(s), e.g. {missing[0]}")
    ordered.advance(final=True)
    return rows


def _check_sizes(entries: list[protocols.TensorEntry], max_tensor_bytes: int | None) -> None:
    largest = max(entries, key=lambda e: e.nbytes, default=None)
    if max_tensor_bytes is not None and largest is not None and largest.nbytes > max_tensor_bytes:
        raise ValueError(
            f"tensor {largest.path} has {largest.nbytes:,} bytes, over this server's limit of "
            f"{max_tensor_bytes:,}; split it or raise the server's --max-tensor-bytes"
        )


def partial_fingerprint(
    source_path: str | os.PathLike,
    destination: str | os.PathLike,
    recipe: dict[str, Any],
    output_format: str | None = None,
) -> dict[str, Any]:
    """The fingerprint quantize_checkpoint gives (and checks) the partial output of these
    arguments (staging.PartialOutput)."""
    with formats.open_source(source_path) as source:
        planned = plan_lib.plan_source(
            source, source_path, destination, recipe, output_format, engine=False
        )
        return _fingerprint(planned, source.entries())


def _fingerprint(
    plan: plan_lib.Plan,
    entries: list[protocols.TensorEntry],
    replaced: replaced_lib.ReplacedSource | None = None,
) -> dict[str, Any]:
    out = {
        # NVFP4 in compressed-tensors: each tensor's global scale is in the recipe.
        "recipe": plan.quantize_recipe,
        "format": plan.format,
        "source": _source_fingerprint(plan.source, plan.source_format, entries),
    }
    if replaced is not None:
        out["replaced"] = replaced.digest()
    return out


def _source_fingerprint(
    source_path: str | os.PathLike, fmt: str, entries: list[protocols.TensorEntry]
) -> dict[str, Any]:
    """What identifies the source without reading its data: its tensors, and its files' sizes
    and modification times."""
    root = pathlib.Path(source_path).absolute()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for e in entries:
        digest.update(f"{e.path}\0{e.dtype.name}\0{e.shape}\n".encode())
    for f in files:
        stat = f.stat()
        digest.update(
            f"{f.relative_to(root.parent)}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode()
        )
    return {"path": str(root), "format": fmt, "sha256": digest.hexdigest()}
