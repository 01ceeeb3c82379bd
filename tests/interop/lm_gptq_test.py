"""`qmill quantize FOLDER --method gptq` on a small Llama that transformers writes, run as a user
runs it: the output loads in transformers with the perplexity qmill reported, every linear is
GPTQ'd, an interrupted or refused run resumes to the same bytes, and bad input is refused before
any work."""

from __future__ import annotations

import json
import pathlib
import subprocess

import numpy as np
import pytest

from qmill.checkpoints.lm import calibration as lm_calibration
from tests import lm_folder
from tests.e2e import processes

VOCAB, LAYERS = lm_folder.VOCAB, lm_folder.LAYERS
LINEARS = 7 * LAYERS


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> pathlib.Path:
    return lm_folder.write_llama(tmp_path_factory.mktemp("lm") / "llama")


@pytest.fixture(scope="module")
def ids(tmp_path_factory) -> dict[str, pathlib.Path]:
    shapes = {"calibration": (16, 32), "eval": (8, 32)}
    return lm_folder.write_ids(tmp_path_factory.mktemp("ids"), shapes)


def _qmill(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*processes.qmill(), *map(str, args)], capture_output=True, text=True, timeout=300
    )


def _gptq_args(llama, ids, output, *extra) -> list:
    return [
        "quantize", llama, "-o", output, "--recipe", "W4A16", "--group-size", "32",
        "--method", "gptq", "--calibration-ids", ids["calibration"],
        "--eval-ids", ids["eval"], *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def gptq_run(llama, ids, tmp_path_factory) -> tuple[pathlib.Path, dict]:
    root = tmp_path_factory.mktemp("gptq")
    output, report = root / "llama-gptq", root / "report.json"
    done = _qmill(*_gptq_args(llama, ids, output, "--report-json", report))
    assert done.returncode == 0, done.stderr
    assert f"layer {LAYERS}/{LAYERS}: GPTQ loss" in done.stderr and "ETA" in done.stderr
    assert not lm_calibration.work_directory(output).exists()  # removed once written
    return output, json.loads(report.read_text())


def _perplexity(folder: pathlib.Path, ids: np.ndarray) -> tuple[float, np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor(ids, dtype=torch.long), labels=torch.tensor(ids).long())
    return float(np.exp(out.loss.item())), out.logits.numpy()


def test_output_loads_in_transformers_with_the_reported_perplexity(gptq_run, llama, ids):
    output, report = gptq_run
    evaluation = np.load(ids["eval"])
    source, _ = _perplexity(llama, evaluation)
    quantized, _ = _perplexity(output, evaluation)
    # Both sides compute in float32 from the same bf16 weights and codes × scales; they differ
    # only in summation order (~1e-6 relative per logit here), far inside 1e-4.
    assert report["perplexity"]["source"] == pytest.approx(source, rel=1e-4)
    assert report["perplexity"]["quantized"] == pytest.approx(quantized, rel=1e-4)
    assert report["perplexity"]["quantized"] != report["perplexity"]["source"]
    config = json.loads((output / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["W4A16"]["weights"]
    assert (group["num_bits"], group["group_size"], group["strategy"]) == (4, 32, "group")


def test_every_linear_is_gptqd_and_the_rest_kept(gptq_run):
    _, report = gptq_run
    methods = {row["path"]: row["method"] for row in report["tensors"]}
    linears = [p for p in methods if p.endswith("proj.weight")]
    assert len(linears) == LINEARS
    assert {methods[p] for p in linears} == {"GPTQ"}, methods
    assert {methods[p] for p in methods if p not in linears} == {""}  # kept: embedding, norms
    layers = report["calibration"]["layers"]
    assert [entry["layer"] for entry in layers] == list(range(LAYERS))
    assert all(len(entry["losses"]) == 7 and entry["loss"] > 0 for entry in layers)
    assert report["calibration"]["gptq"] == {
        "block_size": 128,
        "dampening": 0.01,
        "actorder": "static",
    }


def test_gptq_output_is_closer_to_the_source_than_round_to_nearest(gptq_run, llama, ids):
    output, _ = gptq_run
    rtn = output.with_name("llama-rtn")
    done = _qmill("quantize", llama, "-o", rtn, "--recipe", "W4A16", "--group-size", "32")
    assert done.returncode == 0, done.stderr
    # On the calibration windows GPTQ minimises each layer's output error: the logits it
    # gives must be clearly closer to the float model's than round to nearest's.
    calibration = np.load(ids["calibration"])
    _, reference = _perplexity(llama, calibration)
    errors = {}
    for name, folder in (("gptq", output), ("rtn", rtn)):
        errors[name] = float(np.mean((_perplexity(folder, calibration)[1] - reference) ** 2))
    assert errors["gptq"] < 0.9 * errors["rtn"], errors


def test_an_interrupted_run_resumes_to_the_same_bytes(gptq_run, llama, ids, tmp_path):
    output, _ = gptq_run
    again = tmp_path / "llama-gptq"
    interrupt_after_first_layer(llama, ids, again, "gptq")
    assert (lm_calibration.work_directory(again) / "layer-00000.npz").is_file()
    done = _qmill(*_gptq_args(llama, ids, again))
    assert done.returncode == 0, done.stderr
    assert "layer 1/3" not in done.stderr and "layer 2/3" in done.stderr  # resumed after 1
    for name in ("model.safetensors", "config.json"):
        assert (again / name).read_bytes() == (output / name).read_bytes(), name


def interrupt_after_first_layer(llama, ids, destination: pathlib.Path, method: str) -> None:
    """Calibrates `llama` W4A16 g32 with `method` in process, interrupted (KeyboardInterrupt)
    once its first layer is kept."""
    from qmill.client import recipes

    request = lm_calibration.LmRequest(
        calibration_ids=np.load(ids["calibration"]), eval_ids=np.load(ids["eval"]), method=method
    )

    def stop_after_first_layer(progress: lm_calibration.LayerProgress) -> None:
        if progress.layer == 0:
            raise KeyboardInterrupt

    recipe = recipes.with_group_size(recipes.load("W4A16"), 32)
    with pytest.raises(KeyboardInterrupt):
        lm_calibration.calibrate(
            llama, destination, recipe, request, progress=stop_after_first_layer
        )


def test_layers_kept_by_another_qmill_are_computed_again_with_a_notice(llama, ids, tmp_path):
    """What an upgrade finds: the kept layers of another code version (its meta.json's code)
    are discarded, not resumed, with one line saying why; the run then gives every layer as a
    fresh run does. In process, after the test above compiled the layers (~1 s)."""
    from qmill.client import recipes

    output = tmp_path / "llama-gptq"
    work = lm_calibration.work_directory(output)
    recipe = recipes.with_group_size(recipes.load("W4A16"), 32)
    request = lm_calibration.LmRequest(calibration_ids=np.load(ids["calibration"]))

    def stop_after_first_layer(progress: lm_calibration.LayerProgress) -> None:
        if progress.layer == 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        lm_calibration.calibrate(llama, output, recipe, request, progress=stop_after_first_layer)
    with np.load(work / "layer-00000.npz") as kept:
        first = {name: kept[name] for name in kept.files}
    meta = json.loads((work / "meta.json").read_text())
    (work / "meta.json").write_text(json.dumps({**meta, "code": "0" * 16}))
    layers, lines = [], []
    done = lm_calibration.calibrate(
        llama, output, recipe, request, progress=lambda p: layers.append(p.layer),
        notice=lines.append,
    )  # fmt: skip
    assert layers == list(range(LAYERS))
    assert len(lines) == 1 and "another version of qmill" in lines[0], lines
    assert json.loads((work / "meta.json").read_text())["code"] == meta["code"]
    assert sorted(done.methods.values()) == ["gptq"] * LINEARS
    with np.load(work / "layer-00000.npz") as again:
        assert set(again.files) == set(first)
        for name in first:
            np.testing.assert_array_equal(again[name], first[name], err_msg=name)


def test_a_perplexity_gate_refuses_then_the_kept_calibration_is_reused(
    gptq_run, llama, ids, tmp_path
):
    output, _report = gptq_run
    gated = tmp_path / "gated"
    refused = _qmill(*_gptq_args(llama, ids, gated, "--max-ppl-increase", "-100"))
    assert refused.returncode == 1
    assert "more than --max-ppl-increase -100 %" in refused.stderr
    assert "nothing was written" in refused.stderr and "Traceback" not in refused.stderr
    assert not gated.exists()
    done = _qmill(*_gptq_args(llama, ids, gated))
    assert done.returncode == 0, done.stderr
    assert "layer 1/3" not in done.stderr  # every layer came from the kept calibration
    assert (gated / "model.safetensors").read_bytes() == (output / "model.safetensors").read_bytes()


def test_bad_input_is_refused_before_any_work(llama, ids, tmp_path):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    for name in ("model.safetensors",):
        (gpt2 / name).write_bytes((llama / name).read_bytes())
    wrong_ids = tmp_path / "big.npy"
    np.save(wrong_ids, np.full((2, 8), VOCAB + 5, np.int32))
    cases = {
        "llama": [gpt2, "--calibration-ids", ids["calibration"]],
        "outside the model's vocabulary": [llama, "--calibration-ids", wrong_ids],
        "more than --max-memory 1KiB": [
            llama, "--calibration-ids", ids["calibration"], "--max-memory", "1KiB",
        ],
        "takes one of --calibration-text or --calibration-ids": [llama],
        "this llama model has no experts": [
            llama, "--calibration-ids", ids["calibration"], "--calibrate-all-experts",
        ],
    }  # fmt: skip
    for expected, args in cases.items():
        output = tmp_path / "out"
        done = _qmill("quantize", args[0], "-o", output, "--recipe", "W4A16",
                      "--group-size", "32", "--method", "gptq", *args[1:])  # fmt: skip
        assert done.returncode == 1, (expected, done.stderr)
        assert expected in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert not output.exists() and not lm_calibration.work_directory(output).exists()
    no_method = _qmill("quantize", llama, "-o", tmp_path / "x", "--eval-ids", ids["eval"])
    assert no_method.returncode == 1 and "add --method gptq" in no_method.stderr


def test_dry_run_prints_the_memory_estimate(llama, ids, tmp_path):
    done = _qmill(*_gptq_args(llama, ids, tmp_path / "out", "--dry-run"))
    assert done.returncode == 0, done.stderr
    assert "calibration memory estimate" in done.stdout and "3 layers" in done.stdout
    assert not (tmp_path / "out").exists()
