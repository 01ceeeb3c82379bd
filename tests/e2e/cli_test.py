"""The qmill CLI as a user runs it: the README quick start, errors, and serve + quantize."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from qmill import checkpoints
from qmill.cli import main as cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
QMILL = [sys.executable, "-m", "qmill.cli"]


def _qmill_bin() -> list[str]:
    exe = shutil.which("qmill", path=os.path.dirname(sys.executable))
    return [exe] if exe else QMILL


def _quickstart_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- quickstart.*?-->\s*```bash\n(.*?)```", readme, re.S)
    assert block, "README lost its quickstart block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_quickstart_runs_verbatim(tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    for command in _quickstart_commands():
        result = subprocess.run(
            command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr
    assert "tensors quantized" in result.stdout
    with checkpoints.open_source(tmp_path / "tiny-mlp-int8") as out:
        paths = {e.path: e for e in out.entries()}
    assert paths["params/Dense_0/kernel/array/qvalue"].dtype.name == "int8"
    assert "params/Dense_0/bias" in paths


def test_an_output_named_npz_is_an_npz_even_from_orbax(tmp_path):
    out = tmp_path / "tiny.npz"
    result = subprocess.run(
        [*QMILL, "quantize", str(ROOT / "examples/tiny-mlp"), "-o", str(out), "--recipe", "int8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert out.is_file()
    with checkpoints.open_source(out) as written:
        assert written.format == "npz"
        assert "params/Dense_0/kernel/array/qvalue" in {e.path for e in written.entries()}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["quantize", "examples/tiny-mlp", "-o", "{tmp}/o", "--recipe", "int9"],
            "neither a preset",
        ),
        (
            # INT8 is int8 (presets in any case, issue 38); a preset one letter off is not.
            ["quantize", "examples/tiny-mlp", "-o", "{tmp}/o", "--recipe", "int-8"],
            "did you mean int8?",
        ),
        (["quantize", "{tmp}/missing", "-o", "{tmp}/o"], "missing"),
        (
            [
                "quantize",
                "examples/tiny-mlp",
                "-o",
                "{tmp}/o",
                "--server",
                "127.0.0.1:1",
                "--timeout",
                "5",
            ],
            "UNAVAILABLE",
        ),
    ],
)
def test_user_errors_print_one_line_and_exit_1(tmp_path, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = subprocess.run(
        [*_qmill_bin(), *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("qmill: error:") and message in result.stderr
    # Nothing at all: no output, and no partial output when no tensor was finished.
    assert list(tmp_path.iterdir()) == []


def test_in_process_errors_speak_of_the_input_not_of_grpc(tmp_path, capsys, monkeypatch):
    recipe = tmp_path / "tiles.toml"
    recipe.write_text('[[rules]]\nqtype = "int4"\ntile_size = 32\n')
    monkeypatch.chdir(ROOT)
    argv = ["quantize", "examples/tiny-mlp", "-o", str(tmp_path / "o"), "--recipe", str(recipe)]
    assert cli.main([*argv, "-q"]) == 1
    err = capsys.readouterr().err
    # No RPC was made: no status name, the tensor and what to change.
    assert err.startswith("qmill: error: params/Conv_0/kernel: tile size 32 does not divide"), err
    assert "INVALID_ARGUMENT" not in err and "tile_if_divisible" in err


def test_an_output_in_a_folder_that_does_not_exist_is_refused(tmp_path, capsys):
    out = tmp_path / "nodir" / "sub" / "out.safetensors"
    assert cli.main(["quantize", str(ROOT / "examples/tiny-mlp"), "-o", str(out), "-q"]) == 1
    err = capsys.readouterr().err
    assert f"folder {out.parent} does not exist" in err and "mkdir -p" in err
    assert list(tmp_path.iterdir()) == []  # no folders made


def test_safetensors_to_a_name_without_the_suffix_says_it_wrote_a_folder(tmp_path, capsys):
    out = tmp_path / "weights"
    argv = ["quantize", str(ROOT / "examples/tiny-mlp"), "-o", str(out), "-q"]
    assert cli.main([*argv, "--format", "safetensors"]) == 0
    assert (out / "model.safetensors").is_file()
    err = capsys.readouterr().err
    assert f"{out} is a folder (model.safetensors)" in err and "-o weights.safetensors" in err
    # A name that says .safetensors is one file, and nothing is said.
    assert cli.main([*argv[:3], str(tmp_path / "w.safetensors"), "-q"]) == 0
    assert (tmp_path / "w.safetensors").is_file() and capsys.readouterr().err == ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_quantize_and_graceful_sigterm(tmp_path):
    port = _free_port()
    data = tmp_path / "data"
    server = subprocess.Popen(
        [*_qmill_bin(), "serve", "--port", str(port), "--grace", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "QMILL_DATA_DIR": str(data)},
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            caps = subprocess.run(
                [*_qmill_bin(), "capabilities", "--server", f"127.0.0.1:{port}"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            if caps.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert caps.returncode == 0, caps.stderr
        assert "int8" in caps.stdout
        assert caps.stdout.startswith("qmill ") and ": cpu\n" not in caps.stdout  # not "cpu: cpu"
        result = subprocess.run(
            [
                *_qmill_bin(),
                "quantize",
                "examples/tiny-mlp",
                "-o",
                str(tmp_path / "out"),
                "--server",
                f"127.0.0.1:{port}",
                "--recipe",
                "fp8",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
        assert (tmp_path / "out").is_dir()
    finally:
        server.send_signal(signal.SIGTERM)
        log, _ = server.communicate(timeout=60)
    assert server.returncode == 0, log
    assert "QuantizeParams" in log and "outcome=ok" in log
    assert "qmill stopped" in log
    # It said where it keeps what outlives a call.
    assert f"keeping uploads in {data / 'uploads'}, calibrations in {data / 'calibrations'}" in log
    assert f"batch jobs in {data / 'jobs.sqlite3'}" in log
