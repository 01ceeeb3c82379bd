"""Calibrations expire after the server's --calibration-expiry-seconds without use, on a fake clock
(as the uploads' tests): each use refreshes one, a sweep removes the expired ones but those
running or being read, and an expired id answers NOT_FOUND saying it expired. Program
calibrations through CalibrationStore; language models through LmCalibrations.calibrate with the
layer-by-layer calibration itself replaced by one that keeps a layer (the real one, on a real
server: tests/integration/lm_jobs_test.py)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from qmill.checkpoints.lm import calibration as lm_calibration
from qmill.checkpoints.lm import work as lm_work
from qmill.cli import lm_jobs
from qmill.client import recipes
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import errors
from qmill.server.calibrator import expiry as expiry_lib
from qmill.server.calibrator import language_model
from qmill.server.calibrator import store as store_lib

TTL = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path, clock) -> store_lib.CalibrationStore:
    return store_lib.CalibrationStore(
        tmp_path / "calibrations", expiry=expiry_lib.Expiry(seconds=TTL, clock=clock)
    )


def _cal(cid: str, tenant: str = "a") -> store_lib.Calibration:
    stats = {"Dense_0": {"dot_general0_lhs": {"count": np.array(3, np.int32)}}}
    return store_lib.Calibration(
        id=cid, tenant=tenant, model_key="m", rules_key="[]", batches=1, examples=3, stats=stats
    )


def _expired(raised: pytest.ExceptionInfo, cid: str) -> bool:
    message = str(raised.value)
    return (
        f"calibration {cid!r} expired: it went unused for more than 1 minute" in message
        and "--calibration-expiry-seconds); calibrate again" in message
    )


def test_each_use_refreshes_a_calibration_and_the_sweep_removes_it_after_the_expiry(store, clock):
    cid = store.new_id()
    store.save(_cal(cid))
    clock.now += 50
    store.load("a", cid)  # a use: kept 60 s from now
    clock.now += 50
    assert store.sweep() == 0 and store.load_stats("a", cid)
    clock.now += TTL + 1
    with pytest.raises(errors.NotFound) as raised:  # expired, not swept yet: as if it were
        store.load("a", cid)
    assert _expired(raised, cid)
    assert store.sweep() == 1
    assert sorted(p.name for p in store.root.iterdir()) == ["expired"]
    with pytest.raises(errors.NotFound) as raised:
        store.load("a", cid)
    assert _expired(raised, cid)
    with pytest.raises(errors.NotFound) as raised:  # another tenant learns nothing
        store.load("b", cid)
    assert str(raised.value) == f"calibration {cid!r} not found"
    clock.now += TTL + 1  # the tombstone is kept one more expiry period
    store.sweep()
    with pytest.raises(errors.NotFound) as raised:
        store.load("a", cid)
    assert str(raised.value) == f"calibration {cid!r} not found"


def test_no_expiry_keeps_calibrations(tmp_path, clock):
    store = store_lib.CalibrationStore(tmp_path, expiry=expiry_lib.Expiry(seconds=0, clock=clock))
    cid = store.new_id()
    store.save(_cal(cid))
    clock.now += 10 * 365 * 86400
    assert store.sweep() == 0 and store.load("a", cid).batches == 1


def test_durations_read_as_the_flag_s_help_says():
    assert [expiry_lib.describe(s) for s in (604800, 86400, 7200, 60, 90, 0.5)] == [
        "7 days", "1 day", "2 hours", "1 minute", "90 s", "0.5 s",
    ]  # fmt: skip


# ---------------------------------------------------------------------- language models


@pytest.fixture
def folder(tmp_path) -> pathlib.Path:
    """A weight file and config, as the client would upload (never read: calibrate is
    replaced)."""
    (tmp_path / "weights.safetensors").write_bytes(b"not read")
    return tmp_path


@pytest.fixture
def lms(store, monkeypatch) -> language_model.LmCalibrations:
    """The server's LmCalibrations, whose calibration keeps one layer's line (the real one:
    the integration test)."""

    def calibrate(folder, destination, recipe, request, *, progress, check):
        calibrate.calls += 1
        assert (pathlib.Path(folder) / "model.safetensors").is_file()  # laid out while it runs
        with lm_work.Work(lm_calibration.work_directory(destination), {}, False) as work:
            entry = {"layer": 0, "tensors": {"model.layers.0.mlp.up_proj.weight": {}}}
            (work.directory / "layers.jsonl").write_text(json.dumps(entry) + "\n")
            calibrate.during(work.directory)
        return lm_calibration.LmOutcome(work.directory, {}, [], None)

    calibrate.during = lambda directory: None
    calibrate.calls = 0
    monkeypatch.setattr(lm_calibration, "calibrate", calibrate)
    monkeypatch.setattr(lm_calibration, "check_request", lambda *_: _Config())
    return language_model.beside(store)


class _Config:
    num_layers = 1


def _request() -> pb.CalibrateLanguageModelRequest:
    ids = np.arange(16, dtype=np.int32).reshape(2, 8)
    return pb.CalibrateLanguageModelRequest(
        config_json="{}",
        weight_uploads={"model.safetensors": "u1"},
        recipe=recipes.message(recipes.with_group_size(recipes.load("W4A16"), 32)),
        calibration=lm_jobs.message(lm_calibration.LmRequest(calibration_ids=ids)),
    )


def _calibrate(lms, folder: pathlib.Path, tenant: str = "a") -> language_model.Done:
    return lms.calibrate(
        tenant, _request(), lambda *_: folder / "weights.safetensors", lambda p: None, lambda: None
    )


def test_a_language_model_s_calibration_expires_unless_used_running_or_read(lms, folder, clock):
    done = _calibrate(lms, folder)
    cid, base = done.calibration_id, lms.root / done.calibration_id
    # Its results are read from the kept work: the folder laid out for the run is dropped.
    assert sorted(p.name for p in base.iterdir()) == ["out.qmill-calibration", "tenant"]
    clock.now += 50
    assert list(lms.results("a", cid)) == ["model.layers.0.mlp.up_proj.weight"]  # a use
    clock.now += 50
    assert _calibrate(lms, folder) == done  # a use: its kept summary, nothing run again
    assert lm_calibration.calibrate.calls == 1
    clock.now += 50
    assert lms.sweep() == 0
    clock.now += TTL + 1
    with lms.in_use(cid):  # QuantizeParams reading its results
        assert lms.sweep() == 0 and base.is_dir()
    assert lms.sweep() == 1 and not base.exists()
    with pytest.raises(errors.NotFound) as raised:
        lms.results("a", cid)
    assert _expired(raised, cid)
    # The same request again: the same id, calibrated from the start, found again.
    assert _calibrate(lms, folder).calibration_id == cid
    assert lms.results("a", cid)


def test_a_running_calibration_is_never_swept(lms, folder, clock):
    swept: list[int] = []

    def long_run(directory: pathlib.Path) -> None:  # the run outlives the expiry
        clock.now += 10 * TTL
        swept.append(lms.sweep())
        assert directory.is_dir()

    lm_calibration.calibrate.during = long_run
    cid = _calibrate(lms, folder).calibration_id
    assert swept == [0]
    clock.now += TTL / 2  # its expiry counts from its end, not its start
    assert lms.sweep() == 0 and lms.results("a", cid)
