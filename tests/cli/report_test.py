"""The report people read: 80 columns, no word cut in two (long paths elided in the middle in the
summary, whole in the full table), the worst tensors, kept ones grouped, and a JSON report with
totals, recipe, timings and the worst tensors."""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import pytest
import safetensors.numpy
from rich.console import Console

from qmill.checkpoints.run import pipeline
from qmill.cli import commands, report, report_table

LONG = "model.encoder.layers.11.self_attention.query_key_value_projection.weight"


def _row(path, qtype="int8", sqnr=40.0, before=4096, after=1040, reason="", tiles=""):
    return pipeline.ReportRow(
        path=path,
        shape=(32, 32),
        dtype="float32",
        qtype=qtype,
        sqnr_db=sqnr if qtype != "kept" else float("nan"),
        mean_relative_error=0.01,
        bytes_before=before,
        bytes_after=after if qtype != "kept" else before,
        reason=reason,
        tiles=tiles,
    )


def _summary() -> report.Summary:
    rows = [_row(f"layers.{i}.mlp.weight", sqnr=40.0 + i) for i in range(20)]
    rows.append(_row(LONG, "int4", sqnr=12.5, after=576, tiles="1:16"))
    rows += [_row(f"layers.{i}.norm", "kept", reason="vectors stay in float") for i in range(5)]
    rows.append(_row("step", "kept", reason="int32 tensors are never quantized", before=4))
    recipe = {"rules": [{"path_regex": ".*", "qtype": "int8"}], "convention": "torch"}
    return report.Summary(rows, 2.5, "src", "out", recipe, disk_before=110_000, disk_after=30_000)


def _render(summary: report.Summary, table: str = "summary") -> list[str]:
    console = Console(width=80, record=True, color_system=None)
    console.print(report.render(summary, table))
    return console.export_text().splitlines()


def _path_column(lines: list[str], title: str) -> list[str]:
    """The paths of the row table titled `title`, their wrapped pieces joined again."""
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    header = next(i for i in range(start, len(lines)) if "path" in lines[i] and "shape" in lines[i])
    width = lines[header].index("shape")
    paths: list[str] = []
    for line in lines[header + 2 :]:
        if not line.strip():
            break
        piece = line[:width].strip()
        if line[width:].strip():  # a new row: its other cells are on its first line
            paths.append(piece)
        else:
            paths[-1] += piece
    return paths


def test_80_columns_elide_long_paths_in_the_middle_worst_first_and_kept_grouped():
    summary = _summary()
    lines = _render(summary)
    assert max(len(line) for line in lines) <= 80
    paths = _path_column(lines, "lowest SQNR")
    # The 10 lowest-SQNR tensors, worst first, one line each: the long path keeps its root
    # and its own name, whole pieces of its middle give way to `…`.
    assert paths[1:] == [f"layers.{i}.mlp.weight" for i in range(9)]
    assert paths[0] == "model.encoder.layers.11.…weight"
    text = "\n".join(lines)
    assert any("kept: vectors" in line and " 5 " in line for line in lines), text
    assert any("kept: int32" in line and " 1 " in line for line in lines), text
    assert any("float32 → int8 per channel" in line and " 20 " in line for line in lines), text
    # Totals: the files on disk before and after, and the tensors as stored.
    assert "21/27 tensors quantized in 2.5 s: 107.4 KiB → 29.3 KiB on disk" in " ".join(lines)


def test_full_table_lists_every_tensor_whole_wrapped_after_separators():
    summary = dataclasses.replace(
        _summary(), rows=[*_summary().rows, _row("x/e/kernel", "float8_e4m3fn", tiles="1:128")]
    )
    lines = _render(summary, "full")
    assert max(len(line) for line in lines) <= 80
    paths = _path_column(lines, "qmill: every tensor")
    assert [p.replace(" ", "") for p in paths] == [r.path for r in summary.rows]
    assert any("float8_e4m3fn 1:128" in line for line in lines)  # the qtype is not folded
    start = next(i for i, line in enumerate(lines) if line.startswith("qmill: every tensor"))
    width = lines[start + 2].index("shape")
    end = lines.index(" " * 80, start + 4)
    wrapped = [line[:width].strip() for line in lines[start + 4 : end]]
    # Each line of a wrapped path ends at a separator or ends its path.
    ends = [r.path for r in summary.rows]
    assert all(w.endswith((".", "/")) or any(p.endswith(w) for p in ends) for w in wrapped)
    assert "model.encoder.layers.11." in wrapped


@pytest.mark.parametrize("width", [12, 20, 33, 50])
def test_elide_and_wrap_cut_no_name_that_fits(width):
    path = "model.layers.11.self_attn.q_proj.weight/array/qvalue"
    elided = report_table.elide(path, width)
    assert len(elided) <= width
    head, tail = elided.split("…")
    assert path.startswith(head) and path.endswith(tail)
    assert set(head.replace("/", ".").split(".")) <= set(path.replace("/", ".").split(".")) | {""}
    lines = report_table.wrap(path, width).splitlines()
    assert "".join(lines) == path and all(len(line) <= width for line in lines)
    assert all(line.endswith((".", "/")) for line in lines[:-1])
    assert report_table.elide("params/Dense_0/kernel", 80) == "params/Dense_0/kernel"
    # A name wider than the column is the one thing cut, keeping both its ends.
    single = report_table.elide("x" * 30 + "y" * 30, width)
    assert len(single) == width and single.startswith("x") and single.endswith("y")


def test_the_summary_never_elides_what_tells_two_rows_apart():
    # The layer index used to be the elided middle: two rows read
    # `encoder.layer.….output.dense.weight`, and `model.layers.….mlp.up_proj.weight` hid which.
    paths = [
        "encoder.layer.0.output.dense.weight",
        "encoder.layer.1.output.dense.weight",
        "encoder.layer.0.attention.output.dense.weight",
        "encoder.layer.1.attention.output.dense.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.12.mlp.up_proj.weight",
    ]
    shown = [report_table.elide(p, 28, paths) for p in paths]
    for path, text in zip(paths, shown, strict=True):
        assert all(len(line) <= 28 for line in text.splitlines())
        if "…" not in text:  # wrapped whole: no elision was unambiguous
            assert text.replace("\n", "") == path
            continue
        head, tail = text.split("…")
        # No other path has this start and end: the row names one tensor.
        assert [p for p in paths if p.startswith(head) and p.endswith(tail)] == [path]
    # Rendered in the summary table, every row still names its own tensor.
    summary = report.Summary([_row(p) for p in paths], 1.0, "src", "out", {})
    console = Console(width=60, record=True, force_terminal=False)
    console.print(report.render(summary))
    text = console.export_text()
    assert text.count("encoder.layer.….output.dense.weight") == 0
    assert text.count("model.layers.….mlp.up_proj.weight") == 0


def test_json_report_has_totals_recipe_timings_and_the_worst(tmp_path):
    summary = _summary()
    report.write_json(summary, tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["recipe"] == summary.recipe
    before = sum(r.bytes_before for r in summary.rows)
    assert data["timings"] == {"seconds": 2.5, "mib_per_second": round(before / 2**20 / 2.5, 3)}
    totals = data["totals"]
    assert totals["tensors"] == 27 and totals["quantized"] == 21 and totals["kept"] == 6
    assert totals["tensor_bytes_before"] == sum(r.bytes_before for r in summary.rows)
    assert totals["tensor_bytes_after"] == 20 * 1040 + 576 + 5 * 4096 + 4
    assert (totals["disk_bytes_before"], totals["disk_bytes_after"]) == (110_000, 30_000)
    assert [w["path"] for w in data["worst"]][:2] == [LONG, "layers.0.mlp.weight"]
    assert len(data["worst"]) == report.WORST
    assert data["groups"]["kept: vectors stay in float"]["tensors"] == 5
    # Kept tensors have no SQNR: null, not NaN (which is not JSON).
    assert data["tensors"][-1]["sqnr_db"] is None and len(data["tensors"]) == 27


def test_disk_bytes_counts_files_directories_and_an_index_with_its_shards(tmp_path):
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a").write_bytes(b"x" * 10)
    (tmp_path / "d" / "sub" / "b").write_bytes(b"x" * 5)
    assert report.disk_bytes(tmp_path / "d") == 15
    assert report.disk_bytes(tmp_path / "d" / "a") == 10
    (tmp_path / "s1.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "s2.safetensors").write_bytes(b"x" * 50)
    index = tmp_path / "m.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
    assert report.disk_bytes(index) == 150 + index.stat().st_size


def test_inspect_lists_whole_paths_in_80_columns_without_cutting_names(tmp_path):
    long = "model.layers.11.self_attention.query_key_value_projection.weight"
    tensors = {long: np.zeros((4, 8), np.float32), "step": np.zeros((), np.int32)}
    safetensors.numpy.save_file(tensors, tmp_path / "m.safetensors")
    console = Console(width=80, record=True, color_system=None)
    args = argparse.Namespace(command="inspect", checkpoint=str(tmp_path / "m.safetensors"))
    assert commands.run(args, console, console) == 0
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    cells = [line.split("│")[1].strip() for line in lines if line.startswith("│")]
    assert "".join(cells[1:-1]) == long and cells[-1] == "step"  # header, the long path, step
    assert all(cell.endswith(".") for cell in cells[1:-2])
