"""`qmill submit FOLDER DEST --method gptq --watch` and `qmill quantize FOLDER --server
--method gptq` against `qmill serve`, as a user runs them on one host: the text is tokenized by
the client with the folder's tokenizer.json, the server calibrates, and the output is the
in-process `qmill quantize --method gptq`'s, byte for byte; bad ids are refused in one line."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from tests import lm_folder
from tests.e2e import processes

TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. "
) * 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> pathlib.Path:
    pytest.importorskip("transformers")  # the interop extra writes the folder
    path = lm_folder.write_llama(tmp_path_factory.mktemp("lm") / "llama")
    lm_folder.write_char_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = processes.free_port()
    data = tmp_path_factory.mktemp("server-data")
    (running,) = processes.serve(port, extra=("--data-dir", str(data)))
    yield f"127.0.0.1:{port}"
    processes.kill(running)


def _lm_flags(texts: pathlib.Path) -> list[str]:
    return [
        "--recipe", "W4A16", "--group-size", "32", "--method", "gptq",
        "--calibration-text", str(texts / "calibration.txt"), "--calibration-samples", "8",
        "--calibration-seq-len", "32", "--eval-text", str(texts / "eval.txt"),
        "--eval-samples", "4",
    ]  # fmt: skip


def test_submit_method_gptq_gives_the_in_process_bytes(run_qmill, folder, server, tmp_path):
    (tmp_path / "calibration.txt").write_text(TEXT)
    (tmp_path / "eval.txt").write_text(TEXT[::-1])
    reference = tmp_path / "in-process"
    done = run_qmill("quantize", str(folder), "-o", str(reference), "-q", *_lm_flags(tmp_path))
    assert done.returncode == 0, done.stderr
    dest = tmp_path / "job"
    submitted = run_qmill(
        "submit", str(folder), str(dest), "--server", server, "--watch", *_lm_flags(tmp_path)
    )
    assert submitted.returncode == 0, submitted.stderr
    assert "calibration memory estimate" in submitted.stdout
    assert "succeeded: wrote" in submitted.stdout and "perplexity" in submitted.stdout
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (dest / name).read_bytes() == (reference / name).read_bytes(), name
    remote = tmp_path / "through-the-server"
    done = run_qmill(
        "quantize", str(folder), "-o", str(remote), "--server", server, *_lm_flags(tmp_path)
    )
    assert done.returncode == 0, done.stderr
    assert "layer 3/3: GPTQ loss" in done.stderr and "perplexity" in done.stderr
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (remote / name).read_bytes() == (reference / name).read_bytes(), name


def test_submit_refuses_bad_ids_in_one_line(run_qmill, folder, server, tmp_path):
    ids = tmp_path / "ids.npy"
    np.save(ids, np.full((2, 8), lm_folder.VOCAB + 5, np.int32))
    refused = run_qmill(
        "submit", str(folder), str(tmp_path / "out"), "--server", server, "--recipe", "W4A16",
        "--method", "gptq", "--calibration-ids", str(ids),
    )  # fmt: skip
    assert refused.returncode == 1
    assert "INVALID_ARGUMENT" in refused.stderr and "vocabulary of 256" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "out").exists()
    half = run_qmill("submit", str(folder), str(tmp_path / "o"), "--server", server,
                     "--eval-ids", str(ids))  # fmt: skip
    assert half.returncode == 1 and "add --method gptq" in half.stderr
