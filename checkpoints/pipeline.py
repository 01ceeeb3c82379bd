"""The main job: read a checkpoint tensor by tensor, quantize, write the quantized checkpoint.

Integer and bool tensors are copied without a round trip; float tensors go to the backend (a
server or the embedded engine) and come back quantized or kept. The output appears under its
final name only when every tensor was written; until then finished tensors are kept beside it
(`<destination>.qmill-partial/`) so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from qmill.checkpoints import ct_blocks, errors, formats, protocols, staging
from qmill.checkpoints import outcome as outcome_lib

# The engine quantizes only these; every other dtype is copied without a round trip.
QUANTIZABLE = frozenset({"float16", "bfloat16", "float32", "float64"})


class Backend(Protocol):
    def quantize(
        self, recipe: dict[str, Any], tensors: Any, **kwargs: Any
    ) -> Iterator[outcome_lib.TensorOutcome]: ...


class Progress(Protocol):
    def start(self, total_bytes: int, total_tensors: int) -> None: ...
    def advance(self, nbytes: int) -> None: ...


@dataclasses.dataclass(frozen=True)
class ReportRow:
    path: str
    shape: tuple[int, ...]
    dtype: str
    # qtype for quantized tensors, "kept" otherwise.
    qtype: str
    sqnr_db: float
    mean_relative_error: float
    bytes_before: int
    bytes_after: int
    reason: str = ""
    tiles: str = ""
    # What quantized it when a calibration was given: "GPTQ", "AWQ", "SmoothQuant" or "RTN"
    # (round to nearest: no statistics for it); "" otherwise.
    method: str = ""
    # GPTQ's output SQNR on the calibration inputs, and round to nearest's (outcome.py); NaN
    # where not measured.
    output_sqnr_db: float = float("nan")
    rtn_output_sqnr_db: float = float("nan")


def quantize_checkpoint(
    source_path: str | os.PathLike,
    destination: str | os.PathLike,
    recipe: dict[str, Any],
    *,
    backend: Backend,
    output_format: str | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    restart: bool = False,
    check: Callable[[], None] | None = None,
    max_tensor_bytes: int | None = None,
    mapped_reads: bool = False,
    in_place: bool = True,
    on_resume: Callable[[int, int], None] | None = None,
    replaced: Mapping[str, Callable[[], np.ndarray]] | None = None,
) -> list[ReportRow]:
    """Quantizes a checkpoint; returns one report row per tensor, in checkpoint order.

    Resumable: every tensor the backend finishes is kept in `<destination>.qmill-partial/`
    (staging.PartialOutput), so calling again with the same arguments after an interruption
    sends only the tensors not yet finished. The checkpoint is written in checkpoint order (as
    tensors finish, _InOrder) from the results, the partial output and the source, so it is
    byte for byte the one an uninterrupted run writes, and appears under its final name only
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

    `replaced`: tensor name → a loader of the array read in place of the source's (same dtype
    and shape): the norms and biases a language model's AWQ / SmoothQuant folded its scales
    into (lm_calibration.py). They are part of the partial output's fingerprint.

    Raises:
        FileExistsError: `destination` exists and `overwrite` is False.
        staging.FingerprintMismatch: a partial output made with another recipe, source or
            format is in the way; `restart=True` discards it.
        ValueError: a tensor is larger than `max_tensor_bytes`.
        errors.OutputError: the output's disk is full, read-only or not writable; the
            finished tensors stay in the partial output.
    """
    dest = pathlib.Path(destination)
    formats.check_destination(source_path, dest, overwrite=overwrite, output_format=output_format)
    with formats.open_source(source_path) as checkpoint:
        if mapped_reads and hasattr(checkpoint, "mapped"):
            checkpoint.mapped = True  # a safetensors source maps its tensors instead of reading
        _check_sizes(checkpoint.entries(), max_tensor_bytes)
        # What the tensors are read from; the writer still takes the source's own layout.
        reads = ReplacedSource(checkpoint, replaced) if replaced else checkpoint
        fingerprint = _fingerprint(
            source_path, reads, checkpoint.entries(), dest, recipe, output_format
        )
        recipe, fmt = fingerprint["recipe"], fingerprint["format"]
        formats.check_output(fmt, checkpoint, recipe)
        # The tensors as the engine quantizes them (compressed-tensors FP8_BLOCK: ragged
        # blocks padded, ct_blocks); the writer works from the source as it is.
        source = formats.engine_view(fmt, reads, recipe)
        entries = source.entries()
        # A full disk or read-only output says what failed and what is kept for resuming.
        opened: list[staging.PartialOutput] = []
        kept = dest.absolute().with_name(dest.name + staging.PARTIAL_SUFFIX)
        with errors.output_failures(
            dest, source_path, kept, lambda: len(opened[0].completed) if opened else 0
        ):
            partial = staging.PartialOutput(dest, fingerprint, restart=restart)
            opened.append(partial)
            try:
                # The recipe goes into a Hugging Face folder's config.json (quantization_config).
                in_place = in_place and formats.writes_in_place(fmt)
                if not in_place and partial.written:
                    raise ValueError(
                        f"{kept} was written in place, which this run does not do; pass "
                        "--restart to discard it"
                    )
                writer = formats.create_writer(
                    dest,
                    fmt,
                    like=checkpoint,
                    overwrite=overwrite,
                    recipe=recipe,
                    in_place=partial.in_place() if in_place else None,
                )
                with writer:
                    ordered = _InOrder(source, entries, partial, writer, check, in_place)
                    done = sum(e.path in partial.completed for e in entries)
                    if done and on_resume is not None:
                        on_resume(done, len(entries))  # (tensors already written, all)
                    rows = _run(source, entries, recipe, backend, partial, progress, ordered)
                    if isinstance(source, ct_blocks.PaddedSource):
                        rows = {path: source.as_stored(path, row) for path, row in rows.items()}
            except BaseException:
                if not partial.completed:
                    partial.discard()  # nothing finished: nothing to keep (an in-place start)
                raise
            finally:
                partial.close()
        partial.discard()
    return [rows[e.path] for e in entries]


def _run(
    source: protocols.TensorSource,
    entries: list[protocols.TensorEntry],
    recipe: dict[str, Any],
    backend: Backend,
    partial: staging.PartialOutput,
    progress: Progress | None,
    ordered: _InOrder,
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
        if not _sendable(entry.dtype):
            rows[entry.path] = _kept_row(entry, f"{entry.dtype.name} tensors are never quantized")
        elif entry.path in partial.completed:
            rows[entry.path] = ReportRow(**_row_fields(partial.completed[entry.path]["info"]))
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
    for outcome in backend.quantize(recipe, tensors()):
        entry = by_path[outcome.path]
        if outcome.quantized:
            row = _quantized_row(entry, outcome)
            parts = outcome.parts
            ordered.check_parts(entry.path, parts)  # before it is kept for resuming
        else:
            # A kept tensor is the source's own: the checkpoint is written from the source.
            row = _kept_row(entry, outcome.reason)
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


class _InOrder:
    """Writes the checkpoint in entry order while tensors finish, not after the last one.

    A tensor is written once every entry before it is: in a single stream results come in
    order, so each is written as it arrives, from the parts in memory, while the backend works
    on the next ones. Results that come early (several replicas or streams) wait in the partial
    output until their turn. Kept and never-sent tensors are read from the source here, from
    the caller's thread: only when the source allows reads from several threads (the backend's
    request thread reads it too), else at the end. The order, and so the checkpoint's bytes,
    are those of writing everything at the end.

    In place (the writer was given staging.InPlace): a result written on arrival is kept for
    resuming by the writer's own data, noted in its log line with every entry written since the
    last line (`take`), instead of as parts written a second time. A resumed run starts after
    the entries those notes name.
    """

    def __init__(
        self,
        source: protocols.TensorSource,
        entries: list[protocols.TensorEntry],
        partial: staging.PartialOutput,
        writer: Any,
        check: Callable[[], None] | None,
        in_place: bool = False,
    ) -> None:
        self._source = source
        self._entries = entries
        self._partial = partial
        self._writer = writer
        self.check = check
        self._in_place = in_place
        # A run that does not write in place has no such notes (quantize_checkpoint refuses).
        self._next = len(partial.written)
        written = [note["path"] for note in partial.written]
        if written != [e.path for e in entries[: len(written)]]:
            raise ValueError(
                f"{partial.directory}: the log's entries written in place are not the "
                "checkpoint's first ones; pass --restart to discard the partial output"
            )
        self._notes: list[dict[str, Any]] = []  # entries written in place, not yet in the log
        self._source_reads = getattr(source, "concurrent_reads", False)
        # A write that failed while tensors were still coming (a full disk): raised at the end,
        # once every result is in the partial output, as when the checkpoint was written last.
        self._failed: OSError | None = None

    def check_parts(self, path: str, parts: dict[str, Any]) -> None:
        """Raises the writer's ValueError for parts its format cannot hold (compressed-tensors:
        an AWQ / SmoothQuant scale), before the tensor is recorded in the partial output."""
        check = getattr(self._writer, "check_parts", None)
        if check is not None:
            check(path, parts)

    def take(self, index: int, path: str, parts: dict[str, Any], info: dict[str, Any]) -> None:
        """Keeps the result for entry `index` (`parts`, empty when the source's own tensor is
        kept) for resuming, and writes what its arrival lets through."""
        turn = self._next == index and self._failed is None
        if self._in_place and turn:
            try:
                self._write((path, parts), final=False)
            except OSError as e:
                self._failed = e  # kept as parts below; the rest of the run writes no more
            if self._failed is None and self._next > index:
                self._partial.record_written(path, info, self._notes)
                self._notes = []
                return
        self._partial.record(index, path, parts, info)
        self.advance(fresh=(path, parts))

    def advance(
        self, *, fresh: tuple[str, dict[str, np.ndarray]] | None = None, final: bool = False
    ) -> None:
        """Writes every entry whose turn has come; `fresh`: the (path, parts) just recorded;
        `final`: every tensor is finished, write the rest."""
        if self._failed is not None:
            if final:
                raise self._failed
            return
        try:
            self._write(fresh, final)
        except OSError as e:
            if final:
                raise
            self._failed = e

    def _write(self, fresh: tuple[str, dict[str, np.ndarray]] | None, final: bool) -> None:
        while self._next < len(self._entries):
            entry = self._entries[self._next]
            parts = self._parts(entry.path, fresh)
            if parts is None and _sendable(entry.dtype) and not final:
                return  # not answered yet
            if parts:
                if self.check is not None:
                    self.check()
                self._writer.write_quantized(entry.path, parts)
                names = {k: np.dtype(v.dtype).name for k, v in parts.items()}
                note = {"call": "quantized", "parts": names}
            elif final or self._source_reads:
                if self.check is not None:
                    self.check()
                array = self._source.read(entry.path)
                self._writer.write(entry.path, array)
                note = {"call": "source", "dtype": array.dtype.name, "shape": list(array.shape)}
            else:
                return
            if self._in_place:
                self._notes.append(
                    {"path": entry.path, **note, "events": self._writer.take_events()}
                )
            self._next += 1

    def _parts(
        self, path: str, fresh: tuple[str, dict[str, np.ndarray]] | None
    ) -> dict[str, Any] | None:
        """The result for `path`: its parts, {} for the source's own tensor, None if none yet."""
        if fresh is not None and fresh[0] == path:
            return fresh[1]
        done = self._partial.completed.get(path)
        if done is None:
            return None
        return self._partial.load(path) if done["parts"] else {}


class ReplacedSource:
    """`source` with some tensors read from loaders instead (same dtype and shape)."""

    def __init__(
        self, source: protocols.TensorSource, loaders: Mapping[str, Callable[[], np.ndarray]]
    ) -> None:
        self._source = source
        self._loaders = dict(loaders)
        self._entries = {e.path: e for e in source.entries()}
        unknown = sorted(set(self._loaders) - set(self._entries))
        if unknown:
            raise ValueError(f"replaced tensors not in the source: {', '.join(unknown[:3])}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    def entries(self) -> list[protocols.TensorEntry]:
        return self._source.entries()

    def read(self, path: str) -> np.ndarray:
        load = self._loaders.get(path)
        if load is None:
            return self._source.read(path)
        array, entry = np.asarray(load()), self._entries[path]
        if array.dtype != entry.dtype or tuple(array.shape) != entry.shape:
            raise ValueError(
                f"{path}: its replacement is {array.dtype}{list(array.shape)}, the source's "
                f"{entry.dtype}{list(entry.shape)}"
            )
        return array

    def digest(self) -> str:
        """sha256 of the replaced tensors' names and bytes."""
        h = hashlib.sha256()
        for path in sorted(self._loaders):
            h.update(path.encode() + b"\0" + np.ascontiguousarray(self.read(path)).tobytes())
        return h.hexdigest()

    def __enter__(self) -> ReplacedSource:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _check_sizes(entries: list[protocols.TensorEntry], max_tensor_bytes: int | None) -> None:
    largest = max(entries, key=lambda e: e.nbytes, default=None)
    if max_tensor_bytes is not None and largest is not None and largest.nbytes > max_tensor_bytes:
        raise ValueError(
            f"tensor {largest.path} has {largest.nbytes:,} bytes, over this server's limit of "
            f"{max_tensor_bytes:,}; split it or raise the server's --max-tensor-bytes"
        )


def with_default_convention(recipe: dict[str, Any], source_format: str) -> dict[str, Any]:
    """Fills in the convention from the checkpoint format when the recipe does not set one:
    safetensors checkpoints come from PyTorch, Orbax and npz from Flax."""
    if "convention" in recipe:
        return recipe
    return {**recipe, "convention": "torch" if source_format == "safetensors" else "flax"}


def partial_fingerprint(
    source_path: str | os.PathLike,
    destination: str | os.PathLike,
    recipe: dict[str, Any],
    output_format: str | None = None,
) -> dict[str, Any]:
    """The fingerprint quantize_checkpoint gives (and checks) the partial output of these
    arguments (staging.PartialOutput)."""
    with formats.open_source(source_path) as source:
        return _fingerprint(
            source_path, source, source.entries(), pathlib.Path(destination), recipe, output_format
        )


def _fingerprint(
    source_path: str | os.PathLike,
    source: protocols.TensorSource,
    entries: list[protocols.TensorEntry],
    dest: pathlib.Path,
    recipe: dict[str, Any],
    output_format: str | None,
) -> dict[str, Any]:
    fmt = output_format or formats.format_for_destination(dest, source.format)
    recipe = with_default_convention(recipe, source.format)
    out = {
        # NVFP4 in compressed-tensors: each tensor's global scale goes into the recipe first.
        "recipe": formats.prepare_recipe(fmt, source, recipe),
        "format": fmt,
        "source": _source_fingerprint(source_path, source.format, entries),
    }
    if isinstance(source, ReplacedSource):
        out["replaced"] = source.digest()
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


def _row_fields(info: dict[str, Any]) -> dict[str, Any]:
    return dict(info, shape=tuple(info["shape"]))


def _sendable(dtype: np.dtype) -> bool:
    return np.dtype(dtype).name in QUANTIZABLE


def _kept_row(entry: protocols.TensorEntry, reason: str) -> ReportRow:
    return ReportRow(
        path=entry.path,
        shape=tuple(entry.shape),
        dtype=entry.dtype.name,
        qtype="kept",
        sqnr_db=float("nan"),
        mean_relative_error=float("nan"),
        bytes_before=entry.nbytes,
        bytes_after=entry.nbytes,
        reason=reason,
    )


def _quantized_row(entry: protocols.TensorEntry, outcome: outcome_lib.TensorOutcome) -> ReportRow:
    tiles = outcome.how.get("tiled_axes") or {}
    return ReportRow(
        path=entry.path,
        shape=tuple(entry.shape),
        dtype=entry.dtype.name,
        qtype=outcome.how.get("qtype", "?"),
        sqnr_db=outcome.sqnr_db,
        mean_relative_error=outcome.mean_relative_error,
        bytes_before=entry.nbytes,
        bytes_after=outcome.output_bytes,
        tiles=",".join(f"{a}:{t}" for a, t in tiles.items()),
        output_sqnr_db=outcome.output_sqnr_db,
        rtn_output_sqnr_db=outcome.rtn_output_sqnr_db,
    )
