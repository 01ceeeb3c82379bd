"""A full or read-only output disk: one error saying what failed and what is kept for resuming
(issue 18, item 7). The disk is simulated by tests/checkpoints/full_disk.py."""

from __future__ import annotations

import errno
import json
import os

import pytest

from qmill.checkpoints.base import errors, staging
from qmill.checkpoints.formats.safetensors import writer as safetensors_writer
from qmill.checkpoints.run import pipeline
from tests.checkpoints import full_disk
from tests.checkpoints.resume_test import RECIPE, FakeBackend, _make_source

# Ten float tensors (five 16x8 kernels, five vectors) and an int32.
TENSORS = 10


@pytest.fixture
def source(tmp_path, sample):
    return _make_source(tmp_path, "safetensors", sample)


def _log(dest) -> list[str]:
    path = dest.with_name(dest.name + staging.PARTIAL_SUFFIX) / "tensors.jsonl"
    return [json.loads(line)["path"] for line in path.read_text().splitlines()]


def _one_go(source, tmp_path) -> bytes:
    reference = tmp_path / "reference.safetensors"
    pipeline.quantize_checkpoint(source, reference, RECIPE, backend=FakeBackend())
    return reference.read_bytes()


def test_disk_full_part_way_keeps_the_finished_tensors_and_resumes(tmp_path, source, monkeypatch):
    reference = _one_go(source, tmp_path)
    dest = tmp_path / "out.safetensors"
    # Room for a few of the ten tensors' parts and log lines (about 450 bytes each).
    full_disk.limit_writes(monkeypatch, 1500)
    with pytest.raises(errors.OutputError) as failed:
        pipeline.quantize_checkpoint(source, dest, RECIPE, backend=FakeBackend())
    finished = _log(dest)
    assert 1 <= len(finished) < TENSORS
    message = str(failed.value)
    assert message.startswith(f"could not write {dest}: no space left on device")
    partial = dest.absolute().with_name("out.safetensors.qmill-partial")
    kept = "1 finished tensor is" if len(finished) == 1 else f"{len(finished)} finished tensors are"
    assert f"{kept} kept in {partial}/" in message
    assert "run the same command again to resume" in message and "\n" not in message
    assert failed.value.code == "RESOURCE_EXHAUSTED" and failed.value.retry_after is None
    assert not dest.exists()

    monkeypatch.undo()  # space freed: the same call resumes after the finished tensors
    resumed = FakeBackend()
    pipeline.quantize_checkpoint(source, dest, RECIPE, backend=resumed)
    assert len(resumed.sent) == TENSORS - len(finished)
    assert not set(finished) & set(resumed.sent)
    assert dest.read_bytes() == reference


def test_disk_full_while_writing_the_checkpoint_keeps_every_tensor(tmp_path, source, monkeypatch):
    reference = _one_go(source, tmp_path)
    dest = tmp_path / "out.safetensors"
    disk = full_disk._Disk(100)  # only the checkpoint's own writes are short of room
    monkeypatch.setattr(safetensors_writer, "open", disk.open, raising=False)
    with pytest.raises(errors.OutputError) as failed:
        pipeline.quantize_checkpoint(source, dest, RECIPE, backend=FakeBackend())
    assert f"{TENSORS} finished tensors are kept" in str(failed.value)
    assert not dest.exists()
    assert not list(tmp_path.glob(".out.safetensors.qmill-tmp-*"))  # staging cleaned up

    monkeypatch.undo()
    resumed = FakeBackend()
    pipeline.quantize_checkpoint(source, dest, RECIPE, backend=resumed)
    assert resumed.sent == []  # nothing to send again: only the file was left to write
    assert dest.read_bytes() == reference


def test_read_only_output_says_nothing_was_kept(tmp_path, source, monkeypatch):
    full_disk.limit_writes(monkeypatch, -1)
    dest = tmp_path / "out.safetensors"
    with pytest.raises(errors.OutputError) as failed:
        pipeline.quantize_checkpoint(source, dest, RECIPE, backend=FakeBackend())
    message = str(failed.value)
    assert message.startswith(f"could not write {dest}: read-only file system (")
    assert "no finished tensor was kept" in message and "writable output directory" in message
    assert failed.value.code == "PERMISSION_DENIED"
    assert not dest.exists()


def test_an_unreadable_source_is_not_called_an_output_failure(tmp_path):
    source = tmp_path / "src"
    denied = OSError(errno.EACCES, os.strerror(errno.EACCES), str(source / "d" / "shard"))
    with (
        pytest.raises(OSError) as raised,
        errors.output_failures(tmp_path / "out", source, tmp_path / "p", lambda: 0),
    ):
        raise denied
    assert raised.value is denied
    elsewhere = OSError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / "out"))
    with (
        pytest.raises(errors.OutputError, match="permission denied"),
        errors.output_failures(tmp_path / "out", source, tmp_path / "p", lambda: 0),
    ):
        raise elsewhere


def test_a_part_the_full_disk_cut_short_is_not_left_behind(tmp_path, source, monkeypatch):
    # Issue 39: a 0-byte parts/...-qvalue.bin stayed after the failure until a rerun.
    dest = tmp_path / "out.safetensors"
    full_disk.limit_writes(monkeypatch, 1500)
    with pytest.raises(errors.OutputError):
        pipeline.quantize_checkpoint(source, dest, RECIPE, backend=FakeBackend())
    partial = dest.with_name(dest.name + staging.PARTIAL_SUFFIX)
    log = [json.loads(line) for line in (partial / "tensors.jsonl").read_text().splitlines()]
    named = {part["file"] for record in log for part in record["parts"].values()}
    on_disk = {file.name for file in (partial / staging.PARTS).iterdir()}
    assert on_disk == named  # every part file left is a finished tensor's, whole
    assert all((partial / staging.PARTS / name).stat().st_size for name in on_disk)


def test_the_run_that_finishes_deletes_the_staging_a_killed_run_left(tmp_path, source):
    # Issue 39: after a SIGKILL while writing a folder output, `.NAME.qmill-tmp-XXXXXXXX/` stayed
    # beside it even after the resumed run succeeded. Here the killed run's leftovers are made
    # by hand: its staging folder and an old destination it had moved aside.
    dest = tmp_path / "out.safetensors"
    left = [
        tmp_path / ".out.safetensors.qmill-tmp-0123abcd",
        tmp_path / ".out.safetensors.qmill-old-4567ef01",
    ]
    for path in left:
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"half")
    others = [
        tmp_path / ".other.safetensors.qmill-tmp-0123abcd",
        tmp_path / ".out.safetensors.keep",
    ]
    for path in others:
        path.write_bytes(b"not ours")
    pipeline.quantize_checkpoint(source, dest, RECIPE, backend=FakeBackend())
    assert dest.exists()
    assert not any(path.exists() for path in left)
    assert all(path.exists() for path in others)  # another destination's, and no leftover
