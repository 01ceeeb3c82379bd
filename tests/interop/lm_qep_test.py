"""`qmill quantize FOLDER --method qep` on the small Llama of lm_gptq_test (in this process: the
stages compile once for every run here; lm_gptq_test runs the same command as a process):
the output loads in transformers with the perplexity qmill reported, every linear is named QEP,
no correction gives `--method gptq`'s bytes, an interrupted run (whose kept state now holds the
float model's stream too) resumes to the same bytes, and bad input is refused before any
work. tests/engine/lm/qep_test.py measures what the correction does."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from qmill.checkpoints.lm import calibration as lm_calibration
from qmill.cli import main as cli
from tests import lm_folder
from tests.interop import lm_gptq_test as gptq_test

LAYERS = lm_folder.LAYERS
llama = gptq_test.llama
ids = gptq_test.ids


def _args(llama, ids, output, *extra) -> list[str]:
    args = [str(a) for a in gptq_test._gptq_args(llama, ids, output, *extra)]
    args[args.index("gptq")] = "qep"
    return args


def _qmill(capsys, args: list[str]) -> tuple[int, str]:
    """cli.main(args): its exit code and what it printed to stderr."""
    capsys.readouterr()
    code = cli.main(args)
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def qep_run(llama, ids, tmp_path_factory) -> tuple[pathlib.Path, dict]:
    root = tmp_path_factory.mktemp("qep")
    output, report = root / "llama-qep", root / "report.json"
    assert cli.main(_args(llama, ids, output, "--report-json", report)) == 0
    assert not lm_calibration.work_directory(output).exists()
    return output, json.loads(report.read_text())


def test_output_loads_in_transformers_with_the_reported_perplexity(qep_run, llama, ids):
    output, report = qep_run
    evaluation = np.load(ids["eval"])
    # As in lm_gptq_test: float32 on both sides, summation order apart.
    assert report["perplexity"]["source"] == pytest.approx(
        gptq_test._perplexity(llama, evaluation)[0], rel=1e-4
    )
    assert report["perplexity"]["quantized"] == pytest.approx(
        gptq_test._perplexity(output, evaluation)[0], rel=1e-4
    )
    methods = {row["path"]: row["method"] for row in report["tensors"]}
    linears = [p for p in methods if p.endswith("proj.weight")]
    assert len(linears) == 7 * LAYERS and {methods[p] for p in linears} == {"QEP+GPTQ"}
    calibration = report["calibration"]
    assert calibration["method"] == "qep"
    assert calibration["qep"] == {"correction_factor": 0.5, "damping_factor": 0.01}
    assert calibration["gptq"]["block_size"] == 128
    assert all(len(entry["losses"]) == 7 for entry in calibration["layers"])


def test_no_correction_writes_gptqs_bytes_and_the_default_does_not(qep_run, llama, ids, tmp_path):
    output, _ = qep_run
    gptq, uncorrected = tmp_path / "gptq", tmp_path / "qep0"
    assert cli.main([*map(str, gptq_test._gptq_args(llama, ids, gptq)), "-q"]) == 0
    assert cli.main([*_args(llama, ids, uncorrected, "--qep-correction", "0"), "-q"]) == 0
    weights = "model.safetensors"
    assert (uncorrected / weights).read_bytes() == (gptq / weights).read_bytes()
    assert (output / weights).read_bytes() != (gptq / weights).read_bytes()


def test_an_interrupted_run_resumes_to_the_same_bytes(qep_run, llama, ids, tmp_path, capsys):
    output, _ = qep_run
    again = tmp_path / "llama-qep"
    gptq_test.interrupt_after_first_layer(llama, ids, again, "qep")
    with np.load(lm_calibration.work_directory(again) / "state.npz") as state:
        assert any(n.startswith("reference/") for n in state.files)  # the float stream kept
    code, err = _qmill(capsys, _args(llama, ids, again))
    assert code == 0, err
    assert "layer 1/3" not in err and f"layer {LAYERS}/{LAYERS}: QEP+GPTQ loss" in err
    assert "layer 2/3: QEP+GPTQ loss" in err and "ETA" in err
    for name in ("model.safetensors", "config.json"):
        assert (again / name).read_bytes() == (output / name).read_bytes(), name


def test_bad_input_is_refused_before_any_work(llama, ids, tmp_path, capsys):
    mixtral = lm_folder.write(tmp_path / "mixtral", "MixtralConfig", lm_folder.MIXTRAL)
    cases = {
        "this mixtral model has experts: use --method gptq": _args(mixtral, ids, tmp_path / "o"),
        "QEP's correction must be in [0, 1]": _args(
            llama, ids, tmp_path / "o", "--qep-correction", "2"
        ),
        "--qep-correction is --method qep's": [
            *map(str, gptq_test._gptq_args(llama, ids, tmp_path / "o", "--qep-correction", "0.3"))
        ],
    }
    for expected, args in cases.items():
        code, err = _qmill(capsys, args)
        assert code == 1 and expected in err, (expected, err)
        assert not (tmp_path / "o").exists()
        assert not lm_calibration.work_directory(tmp_path / "o").exists()
