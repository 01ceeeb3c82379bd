"""The README's examples run as written, from the root of a fresh copy of the repository, and
leave nothing that breaks CI.

The quick start and every ```bash or ```python block marked `<!-- readme-test ... -->` run in
order, in one copy of the repository's files (tracked, or new and not ignored: what a clone of
this tree holds) with a `git init` of its own, each block as one script (bash with
`set -euo pipefail`; python from stdin). A block with a `qmill serve` line gets that server
started from the line in the background (on a free port in place of the README's 50051, in
every block, with a data dir of its own) and kept for the blocks after it. Then, as CI would:
`ruff check .` passes in that tree, and every file the blocks wrote is git-ignored. The recipe
fields table is the one docs/recipe_fields.py generates.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from qmill import checkpoints
from tests.e2e import processes

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- (readme-test|quickstart)[^>]*-->\s*```(bash|python)\n(.*?)```", re.S)
README_PORT = "50051"


def _blocks() -> list[tuple[str, str]]:
    """(language, text) of each block the README marks as run, in order."""
    blocks = [(lang, text) for _, lang, text in BLOCK.findall((ROOT / "README.md").read_text())]
    assert len(blocks) >= 7, "README lost its tested blocks"
    return blocks


def _fresh_copy(tree: pathlib.Path) -> set[str]:
    """The files a clone of this working tree holds, copied to `tree` (a git repository of its
    own, so that .gitignore applies as in a clone); returns their names."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    names = {name for name in listed.split("\0") if name and (ROOT / name).is_file()}
    for name in names:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    subprocess.run(["git", "init", "-q"], cwd=tree, check=True)
    return names


def _not_ignored(tree: pathlib.Path) -> set[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--others", "--exclude-standard"],
        cwd=tree,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return {name for name in listed.split("\0") if name}


def _start_server(line: str, cwd: pathlib.Path, env: dict[str, str]) -> subprocess.Popen:
    args = shlex.split(line, comments=True)
    assert args[:2] == ["qmill", "serve"], line
    server = subprocess.Popen(
        [*processes.qmill(), *args[1:]], cwd=cwd, env=env, stdout=subprocess.DEVNULL
    )
    port = args[args.index("--port") + 1]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        caps = subprocess.run(
            [*processes.qmill(), "capabilities", "--server", f"127.0.0.1:{port}"],
            capture_output=True,
            timeout=60,
        )
        if caps.returncode == 0:
            return server
        assert server.poll() is None, f"{line} exited with {server.returncode}"
        time.sleep(0.5)
    server.kill()
    raise AssertionError(f"{line}: no answer in 120 s")


def _run_blocks(tree: pathlib.Path, env: dict[str, str]) -> None:
    port = str(processes.free_port())
    servers: list[subprocess.Popen] = []
    try:
        for lang, block in _blocks():
            lines = block.replace(README_PORT, port).splitlines()
            for line in lines:
                if line.startswith("qmill serve"):
                    servers.append(_start_server(line, tree, env))
            script = "\n".join(line for line in lines if not line.startswith("qmill serve"))
            command = ["bash", "-euo", "pipefail", "-c", script]
            result = subprocess.run(
                command if lang == "bash" else [sys.executable, "-"],
                input=None if lang == "bash" else script,
                cwd=tree,
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert result.returncode == 0, f"{script}\n---\n{result.stdout}\n{result.stderr}"
    finally:
        for server in servers:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)


@pytest.mark.slow
def test_readme_blocks_run_as_written_and_leave_nothing_that_breaks_ci(tmp_path):
    tree = tmp_path / "qmill"
    copied = _fresh_copy(tree)
    assert _not_ignored(tree) == copied  # the copy is what a clone holds, .gitignore applied
    bin_dir = os.path.dirname(sys.executable)  # `qmill`, `python` and `ruff` of this environment
    env = {
        **os.environ,
        "PATH": bin_dir + os.pathsep + os.environ["PATH"],
        "QMILL_DATA_DIR": str(tmp_path / "server-data"),  # not the user's ~/.cache/qmill
    }
    _run_blocks(tree, env)

    # What the blocks say they make is there (and the dry run made nothing).
    made = ("tiny-mlp-int8", "model-int4.safetensors", "ckpt-fp8", "ckpt-int8.npz", "out")
    for name in (*made, "cnn-w8a8", "recipe-out.npz", "mlp.tflite", "tiny-mlp-int8.npz"):
        assert (tree / name).exists(), name
    assert not (tree / "ckpt-nf4").exists()
    assert json.loads((tree / "report.json").read_text())["totals"]["quantized"] == 4
    config = json.loads((tree / "tiny-bert-int4" / "config.json").read_text())
    assert config["quantization_config"]["qmill"]["recipe"]["rules"][0]["qtype"] == "int4"
    with checkpoints.open_source(tree / "model-int4.safetensors") as out:
        assert "params/Dense_1/kernel/array/qvalue" in {e.path for e in out.entries()}
    with checkpoints.open_source(tree / "recipe-out.npz") as out:
        paths = {e.path for e in out.entries()}
    assert "params/Conv_0/kernel/array/qvalue" in paths and "params/Embed_0/embedding" in paths
    assert (tree / "cnn.tflite").read_bytes()[4:8] == b"TFL3"  # a LiteRT flatbuffer

    # CI, with the README's files left where the README leaves them: each is git-ignored, and
    # `ruff check .` (which skips ignored files) passes.
    left = sorted(_not_ignored(tree) - copied)
    assert not left, f"the README's examples leave files .gitignore does not list: {left}"
    lint = subprocess.run(["ruff", "check", "."], cwd=tree, env=env, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_the_recipe_fields_table_is_generated_from_the_recipe_dataclass():
    generator = runpy.run_path(str(ROOT / "docs" / "recipe_fields.py"))
    readme = (ROOT / "README.md").read_text()
    assert generator["section"](readme) == generator["table"](), (
        "README's recipe fields are stale: run `python docs/recipe_fields.py`"
    )
