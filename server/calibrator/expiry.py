"""How long the server keeps a calibration: `--calibration-expiry-seconds` after its last use.

A use is a call that continues or reads one: Calibrate naming its id, CalibrateLanguageModel
resuming it, QuantizeParams or ExportOdml reading its statistics or results. The last use is the
modification time of one file of the calibration (its stamp), which each use sets to the clock's
time: no record to rewrite, and a fake clock in tests moves it as it moves the clock. The stores
sweep expired calibrations (the server at start, every Calibrate and CalibrateLanguageModel
call), as uploads are swept (uploads/store.py), so a long-running server's disk does not fill.

A swept calibration leaves a tombstone (`expired/<id>`, its tenant inside) for one more expiry
period, so that its id answers "expired: calibrate again" rather than a bare "not found".
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from collections.abc import Callable

from qmill.server import errors

DEFAULT_SECONDS = 7 * 24 * 3600.0
FLAG = "--calibration-expiry-seconds"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Expiry:
    # Seconds a calibration is kept after its last use; 0: kept until removed by hand.
    seconds: float = DEFAULT_SECONDS
    # The time now, in Unix seconds (tests pass a fake clock, as UploadStore's do).
    clock: Callable[[], float] = time.time

    def touch(self, stamp: pathlib.Path) -> None:
        """Records a use now: the stamp's modification time is the clock's."""
        now = self.clock()
        os.utime(stamp, (now, now))

    def expired(self, stamp: pathlib.Path) -> bool:
        """Whether the calibration whose stamp this is went unused for longer than `seconds`
        (a stamp removed meanwhile: not this sweep's to remove)."""
        if self.seconds <= 0:
            return False
        try:
            return stamp.stat().st_mtime + self.seconds < self.clock()
        except FileNotFoundError:
            return False

    def error(self, calibration_id: str) -> errors.NotFound:
        """What an expired id answers."""
        return errors.NotFound(
            f"calibration {calibration_id!r} expired: it went unused for more than "
            f"{describe(self.seconds)} and this server removed it ({FLAG}); calibrate again"
        )


def describe(seconds: float) -> str:
    """A duration as --help and messages say it: '7 days', '2 hours', '90 s'."""
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size and seconds % size == 0:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n > 1 else ''}"
    return f"{seconds:g} s"


class Tombstones:
    """The ids swept under `root` (`root/expired/<id>`, holding the tenant). Not thread-safe:
    its store calls it under its own lock."""

    def __init__(self, root: pathlib.Path, expiry: Expiry) -> None:
        self._root = root / "expired"
        self._expiry = expiry

    def bury(self, calibration_id: str, tenant: str) -> None:
        self._root.mkdir(parents=True, exist_ok=True)
        stone = self._root / calibration_id
        stone.write_text(tenant)
        self._expiry.touch(stone)

    def lift(self, calibration_id: str) -> None:
        """The id names a calibration again (a language model's id is its request's hash)."""
        (self._root / calibration_id).unlink(missing_ok=True)

    def check(self, tenant: str, calibration_id: str) -> None:
        """Raises the expired error when the tenant's id was swept (another tenant's stays a
        plain 'not found', as its live calibrations do)."""
        stone = self._root / calibration_id
        try:
            buried = stone.read_text() == tenant
        except (FileNotFoundError, NotADirectoryError):
            return
        if buried:
            raise self._expiry.error(calibration_id)

    def sweep(self) -> None:
        """Forgets the tombstones older than one expiry period."""
        for stone in self._root.iterdir() if self._root.is_dir() else ():
            if self._expiry.expired(stone):
                stone.unlink(missing_ok=True)
