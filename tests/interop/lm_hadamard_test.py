"""`qmill quantize FOLDER --method hadamard|hadamard+gptq` on the small Llama of lm_gptq_test,
whose head is tied to its embedding as SmolLM2's (in this process: the stages compile once for
every run here): the output is an ordinary untied Llama that transformers loads with the
perplexity qmill reported, its norms folded to ones, every linear named by its method; and what
the rotation cannot take is refused before any work. tests/engine/lm/rotation_test.py checks
that the rotation leaves the float model's function unchanged."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from qmill.checkpoints.formats.safetensors import source as safetensors_source
from qmill.checkpoints.lm import calibration as lm_calibration
from qmill.cli import main as cli
from tests import lm_folder
from tests.interop import lm_gptq_test as gptq_test

LAYERS = lm_folder.LAYERS
llama = gptq_test.llama
ids = gptq_test.ids


def _args(llama, ids, output, method: str, *extra) -> list[str]:
    args = [str(a) for a in gptq_test._gptq_args(llama, ids, output, *extra)]
    args[args.index("gptq")] = method
    return args


@pytest.fixture(scope="module")
def hadamard_run(llama, ids, tmp_path_factory) -> tuple[pathlib.Path, dict]:
    root = tmp_path_factory.mktemp("hadamard")
    output, report = root / "llama-hadamard", root / "report.json"
    args = _args(llama, ids, output, "hadamard", "--report-json", report, "-q")
    assert cli.main(args) == 0
    assert not lm_calibration.work_directory(output).exists()
    return output, json.loads(report.read_text())


def _tensors(folder: pathlib.Path) -> dict[str, np.ndarray]:
    with safetensors_source.SafetensorsSource([folder / "model.safetensors"]) as weights:
        return {e.path: weights.read(e.path) for e in weights.entries()}


def test_the_output_is_untied_and_loads_with_the_reported_perplexity(hadamard_run, llama, ids):
    output, report = hadamard_run
    config = json.loads((output / "config.json").read_text())
    assert json.loads((llama / "config.json").read_text())["tie_word_embeddings"] is True
    assert config["tie_word_embeddings"] is False
    source, out = _tensors(llama), _tensors(output)
    assert "lm_head.weight" not in source
    # Both E·Q here (this model's final norm is ones: the head takes no other scale), in bf16;
    # tests/engine/lm/rotation_test.py folds norms of other weights.
    head, embed = out["lm_head.weight"], out["model.embed_tokens.weight"]
    assert head.dtype == embed.dtype == source["model.embed_tokens.weight"].dtype
    assert np.array_equal(head, embed)
    assert not np.array_equal(embed, source["model.embed_tokens.weight"])
    norms = [n for n in out if n.endswith("norm.weight")]
    assert len(norms) == 2 * LAYERS + 1 and all(np.all(out[n] == 1) for n in norms)
    evaluation = np.load(ids["eval"])
    # As in lm_gptq_test: float32 on both sides from the same bf16 tensors and codes × scales.
    assert report["perplexity"]["quantized"] == pytest.approx(
        gptq_test._perplexity(output, evaluation)[0], rel=1e-4
    )
    methods = {row["path"]: row["method"] for row in report["tensors"]}
    linears = [p for p in methods if p.endswith("proj.weight")]
    assert len(linears) == 7 * LAYERS and {methods[p] for p in linears} == {"Hadamard"}
    assert report["calibration"]["hadamard"]["seed"] == 0
    assert report["calibration"]["method"] == "hadamard"


def test_hadamard_gptq_takes_the_seed_and_gptqs_the_rotated_weights(
    hadamard_run, llama, ids, tmp_path
):
    output, report_file = tmp_path / "out", tmp_path / "report.json"
    args = _args(llama, ids, output, "hadamard+gptq", "--hadamard-seed", "3")
    assert cli.main([*args, "--report-json", str(report_file), "-q"]) == 0
    report = json.loads(report_file.read_text())
    methods = {row["path"]: row["method"] for row in report["tensors"]}
    assert sorted(methods.values()).count("Hadamard+GPTQ") == 7 * LAYERS
    assert report["calibration"]["hadamard"]["seed"] == 3
    assert report["calibration"]["gptq"]["block_size"] == 128
    assert all(len(entry["losses"]) == 7 for entry in report["calibration"]["layers"])
    # Another seed, another rotation: other bytes for the embedding (no quantization there).
    embed = "model.embed_tokens.weight"
    assert not np.array_equal(_tensors(output)[embed], _tensors(hadamard_run[0])[embed])


def test_what_the_rotation_cannot_take_is_refused_before_any_work(llama, ids, tmp_path, capsys):
    gemma2 = lm_folder.write(
        tmp_path / "gemma2",
        "Gemma2Config",
        dict(lm_folder.SMALL, head_dim=16, sliding_window=5, query_pre_attn_scalar=16),
    )
    out = tmp_path / "o"
    hadamard = _args(llama, ids, out, "hadamard")
    nvfp4 = [*hadamard[:4], "--recipe", "NVFP4A16", *hadamard[8:]]  # no --group-size
    cases = {
        "post_feedforward_layernorm": _args(gemma2, ids, out, "hadamard"),
        "--hadamard-seed is --method hadamard's": [
            *map(str, gptq_test._gptq_args(llama, ids, out, "--hadamard-seed", "1"))
        ],
        "the Hadamard seed must be in [0, 2^32)": _args(
            llama, ids, out, "hadamard", "--hadamard-seed", "-1"
        ),
        "global scales are found from the weights before the rotation": nvfp4,
    }
    for expected, args in cases.items():
        capsys.readouterr()
        code = cli.main(args)
        err = capsys.readouterr().err
        assert code == 1 and expected in err, (expected, err)
        assert not out.exists()
        assert not lm_calibration.work_directory(out).exists()
