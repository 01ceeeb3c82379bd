"""A source file truncated while `qmill quantize --server` sends it (issue 27): a clear error and
no output, never SIGBUS. The client maps a safetensors file's tensors (safetensors_source
`mapped`); touching a mapped page past the end of a file that shrank would kill it."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
import safetensors.numpy

from qmill.checkpoints.formats.safetensors import source as safetensors_source
from qmill.cli import main as cli

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="mapped reads under a lease are Linux's"
)


def _breaking(truncater: subprocess.Popen) -> bool:
    """Whether the truncater waits on the client's lease (or is done already)."""
    return "BREAKING" in pathlib.Path("/proc/locks").read_text() or truncater.poll() is not None


def test_a_source_truncated_mid_run_is_an_error_and_writes_nothing(
    server, tmp_path, monkeypatch, capsys
):
    rng = np.random.default_rng(0)
    source = tmp_path / "w.safetensors"
    # 2 MiB each: mapped, not read (MAP_MIN_BYTES).
    tensors = {f"l{i}.weight": rng.standard_normal((512, 1024), np.float32) for i in range(4)}
    safetensors.numpy.save_file(tensors, str(source))
    read = safetensors_source.SafetensorsSource.read
    truncaters: list[subprocess.Popen] = []

    def read_then_truncate(self, path: str) -> np.ndarray:
        array = read(self, path)
        if not truncaters:  # after the first tensor is mapped, before it is sent
            code = "import os, sys; os.truncate(sys.argv[1], 1000)"
            truncaters.append(subprocess.Popen([sys.executable, "-c", code, str(source)]))
            deadline = time.monotonic() + 30
            while not _breaking(truncaters[0]) and time.monotonic() < deadline:
                time.sleep(0.01)
        return array

    monkeypatch.setattr(safetensors_source.SafetensorsSource, "read", read_then_truncate)
    out = tmp_path / "out.safetensors"
    argv = ["quantize", str(source), "-o", str(out), "--server", server.address, "-q"]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert f"{source} changed while it was being read" in err
    assert "nothing was written" in err
    assert not out.exists()
    # The truncation went ahead once the client let go of the file.
    assert truncaters[0].wait(timeout=60) == 0
    assert source.stat().st_size == 1000


def _open_files(pid: int) -> set[str]:
    """The paths process `pid` holds open; an fd closed while they are listed is skipped (the
    child's interpreter opens and closes files as it starts)."""
    paths = set()
    for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
        try:
            paths.add(os.readlink(fd))
        except FileNotFoundError:
            continue
    return paths


def test_a_file_open_for_writing_elsewhere_is_read_not_mapped(tmp_path):
    path = tmp_path / "w.safetensors"
    tensor = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)
    safetensors.numpy.save_file({"big": tensor}, str(path))
    writer = subprocess.Popen(
        [sys.executable, "-c", "import sys; f = open(sys.argv[1], 'r+b'); sys.stdin.read()", path],
        stdin=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and str(path.resolve()) not in _open_files(writer.pid):
            time.sleep(0.01)
        source = safetensors_source.SafetensorsSource([path])
        source.mapped = True
        try:
            array = source.read("big")
            assert array.flags.writeable  # a pooled buffer: no lease could be taken
            np.testing.assert_array_equal(array, tensor)
        finally:
            source.close()
    finally:
        writer.communicate(b"")
