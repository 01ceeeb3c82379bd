"""The committed stubs must be what the committed .proto generates."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_stubs_are_fresh():
    result = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
