"""`qmill quantize` on a full or read-only output disk: one line saying what failed and what was
kept, exit 1, no traceback; embedded and through a server (issue 18, item 7). The disk is the
launcher shim of tests/checkpoints/full_disk.py; re-running without it resumes."""

from __future__ import annotations

import subprocess

import pytest

from tests.checkpoints import full_disk
from tests.e2e import processes


@pytest.fixture(scope="module")
def server():
    port = processes.free_port()
    (process,) = processes.serve(port)
    yield f"127.0.0.1:{port}"
    processes.kill(process)


def _quantize(command: list[str], out, server: str | None) -> subprocess.CompletedProcess:
    args = [*command, "quantize", str(processes.SOURCE), "-o", str(out), "-q"]
    args += ["--server", server] if server else []
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("where", ["embedded", "remote"])
def test_full_disk_prints_one_line_and_a_rerun_resumes(tmp_path, where, request):
    server = request.getfixturevalue("server") if where == "remote" else None
    out = tmp_path / "out.safetensors"
    # Room for the partial output's first tensors, not for all five.
    failed = _quantize(full_disk.qmill_command(20_000), out, server)
    assert failed.returncode == 1, failed.stderr
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in failed.stderr, failed.stderr
    assert lines[0].startswith(f"qmill: error: could not write {out}: no space left on device")
    assert "finished tensor" in lines[0] and "kept in" in lines[0] and ".qmill-partial/" in lines[0]
    assert not out.exists()

    done = _quantize(processes.qmill(), out, server)
    assert done.returncode == 0, done.stderr
    assert out.exists() and not out.with_name("out.safetensors.qmill-partial").exists()


def test_read_only_output_prints_one_line(tmp_path):
    out = tmp_path / "out.safetensors"
    failed = _quantize(full_disk.qmill_command(-1), out, None)
    assert failed.returncode == 1, failed.stderr
    assert failed.stderr.strip().splitlines() == [
        line for line in failed.stderr.strip().splitlines() if line.startswith("qmill: error:")
    ]
    assert f"could not write {out}: read-only file system" in failed.stderr
    assert "no finished tensor was kept" in failed.stderr and "Traceback" not in failed.stderr
