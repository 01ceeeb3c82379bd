"""Human and machine views of a quantization job: progress bar, quality table, JSON report."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from qmill.checkpoints import pipeline


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


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _db(value: float) -> str:
    if math.isnan(value):
        return "-"
    return "exact" if math.isinf(value) else f"{value:.1f}"


def quality_table(rows: Sequence[pipeline.ReportRow]) -> Table:
    table = Table(title="qmill: per-tensor quality", show_lines=False)
    for name, justify in (
        ("path", "left"),
        ("shape", "left"),
        ("dtype → qtype", "left"),
        ("tiles", "left"),
        ("SQNR dB", "right"),
        ("bytes before → after", "right"),
    ):
        table.add_column(name, justify=justify)
    for r in rows:
        target = r.qtype if r.qtype != "kept" else f"kept ({r.reason})"
        table.add_row(
            r.path,
            "×".join(map(str, r.shape)) or "scalar",
            f"{r.dtype} → {target}",
            r.tiles or "-",
            _db(r.sqnr_db),
            f"{_size(r.bytes_before)} → {_size(r.bytes_after)}",
        )
    return table


def totals_line(rows: Sequence[pipeline.ReportRow], seconds: float) -> str:
    before = sum(r.bytes_before for r in rows)
    after = sum(r.bytes_after for r in rows)
    quantized = sum(r.qtype != "kept" for r in rows)
    ratio = before / after if after else float("inf")
    return (
        f"{quantized}/{len(rows)} tensors quantized, {_size(before)} → {_size(after)} "
        f"({ratio:.2f}× smaller) in {seconds:.1f} s"
    )


def write_json(rows: Sequence[pipeline.ReportRow], path: str | os.PathLike) -> None:
    def clean(v: object) -> object:
        return None if isinstance(v, float) and not math.isfinite(v) else v

    data = [{k: clean(v) for k, v in dataclasses.asdict(r).items()} for r in rows]
    with open(path, "w") as f:
        json.dump({"tensors": data}, f, indent=1)
