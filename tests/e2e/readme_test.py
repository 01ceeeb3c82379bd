"""The README's examples run as written: every ```bash block marked `<!-- readme-test ... -->`,
in order, in one fresh directory holding a copy of examples/, each block as one bash script
(`set -euo pipefail`). A block with a `qmill serve` line gets that server started from the line
in the background (on a free port in place of the README's 50051, in every block) and kept for
the blocks after it. The quickstart block is run by cli_test.py."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

from qmill import checkpoints
from tests.e2e import processes

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- readme-test[^>]*-->\s*```bash\n(.*?)```", re.S)
README_PORT = "50051"


def _blocks() -> list[str]:
    blocks = BLOCK.findall((ROOT / "README.md").read_text())
    assert len(blocks) >= 4, "README lost its tested blocks"
    return blocks


def _start_server(line: str, cwd: pathlib.Path) -> subprocess.Popen:
    args = shlex.split(line, comments=True)
    assert args[:2] == ["qmill", "serve"], line
    server = subprocess.Popen([*processes.qmill(), *args[1:]], cwd=cwd, stdout=subprocess.DEVNULL)
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


def test_readme_blocks_run_as_written(tmp_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    bin_dir = os.path.dirname(sys.executable)  # `qmill` and `python` of this environment
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"]}
    port = str(processes.free_port())
    servers: list[subprocess.Popen] = []
    try:
        for block in _blocks():
            lines = block.replace(README_PORT, port).splitlines()
            for line in lines:
                if line.startswith("qmill serve"):
                    servers.append(_start_server(line, tmp_path))
            script = "\n".join(line for line in lines if not line.startswith("qmill serve"))
            result = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", script],
                cwd=tmp_path,
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

    # What the blocks say they make is there (and the dry run made nothing).
    for made in ("model-int4.safetensors", "ckpt-fp8", "ckpt-int8.npz", "out", "cnn-w8a8"):
        assert (tmp_path / made).exists(), made
    assert not (tmp_path / "ckpt-nf4").exists()
    assert json.loads((tmp_path / "report.json").read_text())["totals"]["quantized"] == 4
    config = json.loads((tmp_path / "tiny-bert-int4" / "config.json").read_text())
    assert config["quantization_config"]["qmill"]["recipe"]["rules"][0]["qtype"] == "int4"
    with checkpoints.open_source(tmp_path / "model-int4.safetensors") as out:
        assert "params/Dense_1/kernel/array/qvalue" in {e.path for e in out.entries()}
    assert (tmp_path / "cnn.tflite").read_bytes()[4:8] == b"TFL3"  # a LiteRT flatbuffer
