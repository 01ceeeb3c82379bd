"""Human and machine views of a quantization job: progress bar, tables, JSON report.

Sizes are what was written: per tensor the bytes as stored (4-bit codes two to a byte, scales and
zero points included), in total the files on disk, stat'ed after the output was committed. The
80-column view shows the lowest-SQNR tensors (long paths elided in the middle), the quantized
tensors grouped by qtype and tiling, the kept ones grouped by reason, and the totals; `full`
lists every tensor with its whole path (wrapped after a separator), as the JSON report does.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import statistics
from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from qmill.checkpoints.run import pipeline
from qmill.cli import report_table


class ProgressBar:
    """Bytes and tensors done, on stderr; silent when stderr is not a terminal."""

    def __init__(self, console: Console) -> None:
        self._progress = Progress(
            TextColumn("[bold]quantizing"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TextColumn("{task.fields[tensors]} tensors"),
            TimeRemainingColumn(),
            console=console,
            transient=True,
        )
        self._bytes = self._progress.add_task("bytes", total=None, tensors="0/?")
        self._tensors = 0
        self._total_tensors = 0

    def __enter__(self) -> ProgressBar:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def start(self, total_bytes: int, total_tensors: int) -> None:
        self._total_tensors = total_tensors
        self._progress.update(self._bytes, total=total_bytes, tensors=f"0/{total_tensors}")

    def advance(self, nbytes: int) -> None:
        self._tensors += 1
        self._progress.update(
            self._bytes, advance=nbytes, tensors=f"{self._tensors}/{self._total_tensors}"
        )


TABLES = ("summary", "full")
WORST = 10  # lowest-SQNR tensors in the summary view and the JSON report


def size_text(n: float) -> str:
    """A byte count as people read it: 512 B, 1.5 KiB ... 2.0 TiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _db(value: float) -> str:
    if math.isnan(value):
        return "-"
    return "exact" if math.isinf(value) else f"{value:.1f}"


def _tiling(r: pipeline.ReportRow) -> str:
    if r.qtype == "kept":
        return "-"
    return f"tiles {r.tiles}" if r.tiles else "per channel"


def disk_bytes(path: str | os.PathLike) -> int:
    """Bytes of the files at `path`: one file, every file under a directory, or for a safetensors
    index the index and the shards it names."""
    path = pathlib.Path(path)
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    if path.name.endswith(".safetensors.index.json"):
        shards = set(json.loads(path.read_text()).get("weight_map", {}).values())
        return path.stat().st_size + sum((path.parent / s).stat().st_size for s in shards)
    return path.stat().st_size


@dataclasses.dataclass(frozen=True)
class Summary:
    """A finished (or planned) run: its rows and what it read and wrote."""

    rows: Sequence[pipeline.ReportRow]
    seconds: float
    source: str
    output: str
    recipe: dict[str, Any]
    # Files on disk; None for a plan (nothing written).
    disk_before: int | None = None
    disk_after: int | None = None
    # A language model calibrated layer by layer: {"perplexity": {"source", "quantized"} or
    # None, "layers": [{"layer", "loss", "seconds", "losses"}], "gptq": its options}.
    calibration: dict[str, Any] | None = None

    @property
    def quantized(self) -> list[pipeline.ReportRow]:
        return [r for r in self.rows if r.qtype != "kept"]

    def worst(self, n: int = WORST) -> list[pipeline.ReportRow]:
        def key(r: pipeline.ReportRow) -> float:
            return math.inf if math.isnan(r.sqnr_db) else r.sqnr_db

        return sorted(self.quantized, key=key)[:n]

    def groups(self) -> dict[str, list[pipeline.ReportRow]]:
        """Rows by what became of them: "float32 → int4 tiles 1:128", "bfloat16 → int8 per
        channel", "kept: why"."""
        out: dict[str, list[pipeline.ReportRow]] = {}
        for r in self.rows:
            name = (
                f"kept: {r.reason or 'kept'}"
                if r.qtype == "kept"
                else f"{r.dtype} → {r.qtype} {_tiling(r)}" + (f", {r.method}" if r.method else "")
            )
            out.setdefault(name, []).append(r)
        return dict(sorted(out.items(), key=lambda kv: (kv[0].startswith("kept"), kv[0])))


def _short(n: float) -> str:
    """3.0K, 306K, 2.2M: the row tables' sizes, kept narrow for 80 columns."""
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:.0f}{unit}" if unit == "B" or n >= 100 else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}G"  # pragma: no cover


def _rows_table(
    title: str, rows: Sequence[pipeline.ReportRow], *, sqnr: bool = True, whole: bool = False
) -> report_table.PathTable:
    # Every column but the path keeps its width; the path takes the rest of the line, elided in
    # the middle (the summary) or wrapped after a separator (`whole`: full table, plan).
    columns = [report_table.Column("shape"), report_table.Column("qtype")]
    if sqnr:
        columns.append(report_table.Column("SQNR", "right"))
    columns.append(report_table.Column("bytes", "right"))
    cells = []
    for r in rows:
        qtype = "kept" if r.qtype == "kept" else f"{r.qtype} {r.tiles}".strip()
        row = [r.path, "×".join(map(str, r.shape)) or "scalar", qtype]
        if sqnr:
            row.append(_db(r.sqnr_db))
        cells.append((*row, f"{_short(r.bytes_before)} → {_short(r.bytes_after)}"))
    return report_table.PathTable(title, columns, cells, whole=whole)


def _median(values: Sequence[float]) -> str:
    values = [v for v in values if not math.isnan(v)]
    return _db(statistics.median(values)) if values else "-"


def _groups_table(summary: Summary, *, sqnr: bool = True) -> Table:
    table = Table(title="by what became of them", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("group", overflow="fold", ratio=1)
    table.add_column("tensors", justify="right")
    table.add_column("bytes", justify="right", no_wrap=True)
    # A calibrated method's own measure (GPTQ: the layer's output on the calibration inputs),
    # beside round to nearest's on the same inputs: the comparison the weight SQNR is not.
    outputs = sqnr and any(not math.isnan(r.output_sqnr_db) for r in summary.rows)
    if sqnr:
        table.add_column("SQNR min/median", justify="right", no_wrap=True)
    if outputs:
        table.add_column("output (RTN)", justify="right", no_wrap=True)
    for name, rows in summary.groups().items():
        values = [r.sqnr_db for r in rows if not math.isnan(r.sqnr_db)]
        quality = f"{_db(min(values))} / {_db(statistics.median(values))}" if values else "-"
        before = sum(r.bytes_before for r in rows)
        after = sum(r.bytes_after for r in rows)
        cells = [name, str(len(rows)), f"{_short(before)} → {_short(after)}"]
        if sqnr:
            cells.append(quality)
        if outputs:
            method = _median([r.output_sqnr_db for r in rows])
            rtn = _median([r.rtn_output_sqnr_db for r in rows])
            cells.append("-" if method == "-" else f"{method} ({rtn})")
        table.add_row(*cells)
    return table


def render(summary: Summary, table: str = "summary", *, plan: bool = False) -> Group:
    """What `qmill quantize` prints: the tensors (`full`) or the worst and the groups
    (`summary`), then the totals."""
    parts: list[Any] = []
    if plan:
        # A plan is read to check what happens to each tensor: every row, always.
        plan_title = "qmill: plan (nothing quantized)"
        parts.append(_rows_table(plan_title, summary.rows, sqnr=False, whole=True))
    elif table == "full":
        parts.append(_rows_table("qmill: every tensor", summary.rows, whole=True))
    else:
        worst = summary.worst()
        title = f"lowest SQNR (dB): {len(worst)} of {len(summary.quantized)} quantized tensors"
        parts.append(_rows_table(title + " (--table full: all)", worst))
    parts.append(_groups_table(summary, sqnr=not plan))
    calibrated = sorted({r.method for r in summary.rows} - {"", "RTN"})
    if calibrated:
        outputs = any(not math.isnan(r.output_sqnr_db) for r in summary.rows)
        parts.append(Text(calibrated_note(calibrated, outputs=outputs)))
    # One unwrapped line (the terminal folds it): a long output path stays whole, to copy or
    # to grep from a log; rich would break it at any character to fit the width.
    parts.append(Text(totals_line(summary, plan=plan), no_wrap=True, overflow="ignore"))
    return Group(*parts)


def calibrated_note(methods: Sequence[str], *, outputs: bool = False) -> str:
    """Why a calibrated method's weight SQNR is not the number to compare with RTN's."""
    compare = (
        "the output column is that error as an SQNR (median), with round to nearest's on the "
        "same inputs in brackets"
        if outputs
        else "compare the model's outputs"
    )
    return (
        f"{' / '.join(methods)}: the SQNR above is the weight's; "
        f"{'these methods minimise' if len(methods) > 1 else 'it minimises'} the layer's output "
        "error on the calibration inputs instead, so a weight SQNR below round-to-nearest's "
        f"(RTN) is expected, not a regression: {compare} (docs/calibrated-methods.md)"
    )


def totals_line(summary: Summary, *, plan: bool = False) -> str:
    rows = summary.rows
    before = sum(r.bytes_before for r in rows)
    after = sum(r.bytes_after for r in rows)
    count = f"{len(summary.quantized)}/{len(rows)} tensors"
    if plan:
        ratio = before / after if after else float("inf")
        return (
            f"plan: {count} would be quantized, tensors {size_text(before)} → {size_text(after)} "
            f"({ratio:.2f}× smaller); nothing was written"
        )
    disk_before, disk_after = summary.disk_before or 0, summary.disk_after or 0
    ratio = disk_before / disk_after if disk_after else float("inf")
    return (
        f"{count} quantized in {summary.seconds:.1f} s: {size_text(disk_before)} → "
        f"{size_text(disk_after)} on disk ({ratio:.2f}× smaller; tensors {size_text(before)} → "
        f"{size_text(after)}) → {summary.output}"
    )


def _clean(v: object) -> object:
    return None if isinstance(v, float) and not math.isfinite(v) else v


def _row(r: pipeline.ReportRow) -> dict[str, Any]:
    return {k: _clean(v) for k, v in dataclasses.asdict(r).items()}


def as_json(summary: Summary) -> dict[str, Any]:
    """The machine view: totals, recipe, timings, groups, the worst tensors and every row."""
    rows = summary.rows
    before = sum(r.bytes_before for r in rows)
    after = sum(r.bytes_after for r in rows)
    groups = {
        name: {
            "tensors": len(g),
            "bytes_before": sum(r.bytes_before for r in g),
            "bytes_after": sum(r.bytes_after for r in g),
        }
        for name, g in summary.groups().items()
    }
    return {
        "source": summary.source,
        "output": summary.output,
        "recipe": summary.recipe,
        "timings": {
            "seconds": round(summary.seconds, 3),
            # Source tensor bytes per second, reading through writing (0 for a plan).
            "mib_per_second": round(before / 2**20 / summary.seconds, 3) if summary.seconds else 0,
        },
        "totals": {
            "tensors": len(rows),
            "quantized": len(summary.quantized),
            "kept": len(rows) - len(summary.quantized),
            # Tensors as stored (4-bit codes two to a byte) ...
            "tensor_bytes_before": before,
            "tensor_bytes_after": after,
            # ... and the files on disk (headers, index, copied files included).
            "disk_bytes_before": summary.disk_before,
            "disk_bytes_after": summary.disk_after,
        },
        "groups": groups,
        "worst": [_row(r) for r in summary.worst()],
        "tensors": [_row(r) for r in rows],
        **(summary.calibration or {}),
    }


def write_json(summary: Summary, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        json.dump(as_json(summary), f, indent=1)
