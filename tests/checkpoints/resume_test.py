"""Resuming `quantize_checkpoint`: an interrupted run continues, and writes the same bytes."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from qmill.checkpoints.base import staging
from qmill.checkpoints.formats import registry as formats
from qmill.checkpoints.run import outcome as outcome_lib
from qmill.checkpoints.run import pipeline
from qmill.client import errors, retry

RECIPE = {"rules": [{"qtype": "int8"}]}
SOURCES = {"orbax": "src", "safetensors": "src.safetensors", "npz": "src.npz"}


class Interrupted(Exception):
    pass


class FakeBackend:
    """Quantizes with numpy (no jax in client tests); 1-D tensors are kept. Raises after
    `fail_after` outcomes, like a server that went away; records what it was sent."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.fail_after = fail_after
        self.sent: list[str] = []

    def quantize(self, recipe, tensors, **_):
        for count, (path, array) in enumerate(tensors):
            if count == self.fail_after:
                raise Interrupted(f"stopped before {path}")
            self.sent.append(path)
            if array.ndim < 2:
                yield outcome_lib.TensorOutcome(path, False, {}, reason="vector")
                continue
            x = np.asarray(array, np.float32)
            scale = np.max(np.abs(x), axis=0, keepdims=True) / 127 + 1e-6
            parts = {
                "qvalue": np.round(x / scale).astype(np.int8),
                "scale": scale.astype(np.float32),
            }
            yield outcome_lib.TensorOutcome(path, True, parts, how={"qtype": "int8"}, sqnr_db=40.0)


def _make_source(tmp_path: pathlib.Path, fmt: str, sample) -> pathlib.Path:
    path = tmp_path / SOURCES[fmt]
    with formats.create_writer(path, fmt) as writer:
        for i in range(5):
            writer.write(f"layer_{i}/kernel", sample(np.float32, (16, 8), seed=i))
            writer.write(f"layer_{i}/bias", sample(np.float32, (8,), seed=10 + i))
        writer.write("step", np.array([7], np.int32))
    return path


def _files(path: pathlib.Path) -> dict[str, bytes]:
    """Every file of an output with its bytes. For Orbax, whose OCDBT store names its data files
    and manifests at random and whose metadata holds commit timestamps (so no two writes match
    byte for byte, resumed or not), the JSON metadata without timestamps and every tensor's
    dtype, shape and bytes as read back."""
    if path.is_file():
        return {"": path.read_bytes()}
    if not (path / "_METADATA").exists():
        return {str(f.relative_to(path)): f.read_bytes() for f in sorted(path.rglob("*"))}
    meta = json.loads((path / "_CHECKPOINT_METADATA").read_text())
    del meta["init_timestamp_nsecs"], meta["commit_timestamp_nsecs"]
    out = {"_CHECKPOINT_METADATA": json.dumps(meta).encode()}
    out["_METADATA"] = (path / "_METADATA").read_bytes()
    with formats.open_source(path) as source:
        for e in source.entries():
            array = source.read(e.path)
            out[e.path] = f"{array.dtype.name}{array.shape}".encode() + array.tobytes()
    return out


def _partial(dest: pathlib.Path) -> pathlib.Path:
    return dest.with_name(dest.name + staging.PARTIAL_SUFFIX)


def _interrupt(source: pathlib.Path, dest: pathlib.Path, after: int) -> None:
    """A run to `dest` whose backend goes away after `after` tensors."""
    with pytest.raises(Interrupted):
        pipeline.quantize_checkpoint(source, dest, RECIPE, backend=FakeBackend(fail_after=after))


def _npz_and_one_shot(tmp_path: pathlib.Path, sample) -> tuple[pathlib.Path, ...]:
    """(npz source, its output quantized in one go, the destination of the run under test)."""
    source = _make_source(tmp_path, "npz", sample)
    one_shot, dest = tmp_path / "a.npz", tmp_path / "b.npz"
    pipeline.quantize_checkpoint(source, one_shot, RECIPE, backend=FakeBackend())
    return source, one_shot, dest


def _resume(source: pathlib.Path, dest: pathlib.Path, one_shot: pathlib.Path) -> list[str]:
    """Runs to `dest` again, to the end; returns the tensors that run sent, once its output is
    checked to be the one-go output byte for byte."""
    resumed = FakeBackend()
    pipeline.quantize_checkpoint(source, dest, RECIPE, backend=resumed)
    assert dest.read_bytes() == one_shot.read_bytes()
    return resumed.sent


def test_resume_skips_finished_tensors_and_writes_identical_bytes(tmp_path, fmt, dest, sample):
    source = _make_source(tmp_path, fmt, sample)
    one_shot = tmp_path / ("one-shot-" + dest.name)
    pipeline.quantize_checkpoint(source, one_shot, RECIPE, backend=FakeBackend())

    _interrupt(source, dest, after=4)
    assert not dest.exists()
    log = (_partial(dest) / "tensors.jsonl").read_text().splitlines()
    assert len(log) == 4

    resumed = FakeBackend()
    rows = pipeline.quantize_checkpoint(source, dest, RECIPE, backend=resumed)
    # 10 float tensors were to be sent; 4 were finished before the interruption.
    assert len(resumed.sent) == 6
    assert not {json.loads(line)["path"] for line in log} & set(resumed.sent)
    assert _files(dest) == _files(one_shot)
    assert not _partial(dest).exists()
    assert [r.path for r in rows] == [
        r.path
        for r in pipeline.quantize_checkpoint(
            source, tmp_path / ("again-" + dest.name), RECIPE, backend=FakeBackend()
        )
    ]
    assert {r.qtype for r in rows} == {"int8", "kept"}


def test_several_interruptions(tmp_path, sample):
    source, one_shot, dest = _npz_and_one_shot(tmp_path, sample)
    for _ in range(3):
        _interrupt(source, dest, after=3)
    assert len(_resume(source, dest, one_shot)) == 1


def test_different_recipe_or_format_needs_restart(tmp_path, sample):
    source = _make_source(tmp_path, "safetensors", sample)
    dest = tmp_path / "out.safetensors"
    _interrupt(source, dest, after=2)
    other = {"rules": [{"qtype": "int4"}]}
    with pytest.raises(staging.FingerprintMismatch, match=r"recipe.*--restart"):
        pipeline.quantize_checkpoint(source, dest, other, backend=FakeBackend())
    with pytest.raises(staging.FingerprintMismatch, match="format"):
        pipeline.quantize_checkpoint(
            source, dest, RECIPE, backend=FakeBackend(), output_format="npz"
        )
    # --restart discards the partial output and starts over.
    fresh = FakeBackend()
    pipeline.quantize_checkpoint(source, dest, other, backend=fresh, restart=True)
    assert len(fresh.sent) == 10
    assert dest.exists() and not _partial(dest).exists()


def test_changed_source_needs_restart(tmp_path, sample):
    source = _make_source(tmp_path, "npz", sample)
    dest = tmp_path / "out.npz"
    _interrupt(source, dest, after=2)
    source.unlink()
    with formats.create_writer(source, "npz") as writer:
        writer.write("other/kernel", sample(np.float32, (4, 4)))
    with pytest.raises(staging.FingerprintMismatch, match="source"):
        pipeline.quantize_checkpoint(source, dest, RECIPE, backend=FakeBackend())


def test_torn_manifest_line_means_that_tensor_is_sent_again(tmp_path, sample):
    source, one_shot, dest = _npz_and_one_shot(tmp_path, sample)
    _interrupt(source, dest, after=3)
    log = _partial(dest) / "tensors.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    # A kill in the middle of the third append: half a line, no newline.
    log.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2])
    assert len(_resume(source, dest, one_shot)) == 8


def test_corrupted_part_is_reported_with_the_fix(tmp_path, sample):
    source = _make_source(tmp_path, "npz", sample)
    dest = tmp_path / "b.npz"
    _interrupt(source, dest, after=3)
    part = next((_partial(dest) / "parts").glob("*-qvalue.bin"))
    data = bytearray(part.read_bytes())
    data[0] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"crc32c.*--restart"):
        pipeline.quantize_checkpoint(source, dest, RECIPE, backend=FakeBackend())
    assert not dest.exists()


def test_existing_destination_is_refused_before_any_work(tmp_path, sample):
    source = _make_source(tmp_path, "npz", sample)
    dest = tmp_path / "out.npz"
    dest.write_bytes(b"keep me")
    backend = FakeBackend()
    with pytest.raises(FileExistsError, match="--overwrite"):
        pipeline.quantize_checkpoint(source, dest, RECIPE, backend=backend)
    assert backend.sent == [] and not _partial(dest).exists()
    pipeline.quantize_checkpoint(source, dest, RECIPE, backend=backend, overwrite=True)
    assert dest.read_bytes() != b"keep me"


class FlakyServer(FakeBackend):
    """Goes UNAVAILABLE after `fail_after` tensors, `outages` times."""

    def __init__(self, fail_after: int, outages: int) -> None:
        super().__init__()
        self.fail_after, self.outages = fail_after, outages

    def quantize(self, recipe, tensors, **_):
        inner = FakeBackend()
        for count, outcome in enumerate(inner.quantize(recipe, tensors)):
            if count == self.fail_after and self.outages:
                self.outages -= 1
                raise errors.QmillError("UNAVAILABLE", "failed to connect to all addresses")
            self.sent.append(outcome.path)
            yield outcome


def test_retries_while_unavailable_resume_the_job(tmp_path, sample):
    source, one_shot, dest = _npz_and_one_shot(tmp_path, sample)
    server, lines, waits = FlakyServer(fail_after=3, outages=2), [], []
    backoff = retry.Backoff(retries=4, initial_seconds=0.5, max_seconds=1.0)
    retry.call(
        lambda: pipeline.quantize_checkpoint(source, dest, RECIPE, backend=server),
        backoff,
        on_retry=lines.append,
        sleep=waits.append,
    )
    assert waits == [0.5, 1.0]
    assert len(lines) == 2 and "server unavailable" in lines[0] and "retry 1/4" in lines[0]
    assert len(server.sent) == 10  # each tensor once, despite two outages
    assert dest.read_bytes() == one_shot.read_bytes()


def test_retries_are_bounded_and_other_errors_are_not_retried(tmp_path):
    waits = []

    def unavailable():
        raise errors.QmillError("UNAVAILABLE", "down")

    with pytest.raises(errors.QmillError, match="UNAVAILABLE"):
        retry.call(
            unavailable, retry.Backoff(retries=3), on_retry=lambda _: None, sleep=waits.append
        )
    assert waits == [1.0, 2.0, 4.0]

    def invalid():
        raise errors.QmillError("INVALID_ARGUMENT", "bad recipe")

    with pytest.raises(errors.QmillError, match="INVALID_ARGUMENT"):
        retry.call(invalid, retry.Backoff(retries=3), on_retry=lambda _: None, sleep=waits.append)
    assert len(waits) == 3
