"""checkpoints/lm/work.Work: kept work made by another qmill (its code_version) is started over
with one notice, never resumed; kept work made with other arguments is still refused. The
calibrations that run through it: tests/interop/lm_gptq_test.py."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

from qmill.checkpoints.lm import work as lm_work

FINGERPRINT = {"source": "/models/llama", "recipe": {"rules": []}, "tokens": "ab12"}


def _keep_a_layer(directory: pathlib.Path, notice=None) -> lm_work.Work:
    with lm_work.Work(directory, FINGERPRINT, False, notice=notice) as work:
        (directory / "layer-00000.npz").write_bytes(b"kept")
        (directory / "layers.jsonl").write_text('{"layer": 0, "tensors": {}}\n')
    return work


def _set_code(directory: pathlib.Path, code: str | None) -> None:
    meta = directory / "meta.json"
    kept = json.loads(meta.read_text())
    kept.pop("code")
    meta.write_text(json.dumps(kept if code is None else {**kept, "code": code}))


@pytest.mark.parametrize("code", ["0123456789abcdef", None], ids=["other", "before-code"])
def test_work_of_another_qmill_is_started_over_with_one_notice(tmp_path, code):
    directory = tmp_path / "out.qmill-calibration"
    _keep_a_layer(directory)
    lines: list[str] = []
    again = lm_work.Work(directory, FINGERPRINT, False, notice=lines.append)
    assert again.layers() == [{"layer": 0}]  # the same code resumes
    _set_code(directory, code)
    with lm_work.Work(directory, FINGERPRINT, False, notice=lines.append) as fresh:
        assert fresh.layers() == [] and fresh.resume() is None
    assert sorted(p.name for p in directory.iterdir()) == ["meta.json"]
    meta = json.loads((directory / "meta.json").read_text())
    assert meta == {**FINGERPRINT, "code": lm_work.code_version()}
    assert len(lines) == 1
    assert "another version of qmill" in lines[0] and "starts over" in lines[0]


def test_work_with_other_arguments_is_refused_whatever_its_code(tmp_path):
    directory = tmp_path / "out.qmill-calibration"
    _keep_a_layer(directory)
    _set_code(directory, "0123456789abcdef")
    other = {**FINGERPRINT, "tokens": "cd34"}
    lines: list[str] = []
    with pytest.raises(ValueError, match="pass --restart to discard it"):
        lm_work.Work(directory, other, False, notice=lines.append)
    assert (directory / "layer-00000.npz").is_file() and lines == []


def test_the_code_version_follows_the_sources(tmp_path, monkeypatch):
    package = tmp_path / "qmill_fake_engine"
    (package / "lm").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    source = package / "lm" / "gptq.py"
    source.write_text("DAMPENING = 0.01\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "qmill_fake_engine", raising=False)
    monkeypatch.setattr(lm_work, "_SOURCES", (("qmill_fake_engine", "lm"),))
    lm_work.code_version.cache_clear()
    try:
        before = lm_work.code_version()
        lm_work.code_version.cache_clear()
        assert lm_work.code_version() == before  # the same sources, the same version
        source.write_text("DAMPENING = 0.02\n")
        lm_work.code_version.cache_clear()
        assert lm_work.code_version() != before
        monkeypatch.setattr(lm_work, "_SOURCES", (("qmill_fake_engine", "moved"),))
        lm_work.code_version.cache_clear()
        with pytest.raises(RuntimeError, match="has no folder 'moved'; update _SOURCES"):
            lm_work.code_version()
    finally:
        lm_work.code_version.cache_clear()
