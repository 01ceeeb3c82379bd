"""Calibrations kept on the server's disk, per tenant: merged quant_stats and how they were made.

A calibration is ``<data_dir>/calibrations/<id>.npz`` (the stats leaves under their '/'-joined
paths, dtypes kept exactly: int32 counts, float32 sums) plus ``<id>.json`` (tenant, model, rules,
totals). A later Calibrate naming the id continues from these stats; ExportOdml reads them. The
npz is replaced atomically, so a reader never sees half of one.

Each use sets the json's modification time (expiry.py): a calibration unused for the server's
expiry is swept, and its id then answers that it expired.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
import secrets
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from qmill.checkpoints.base import files
from qmill.server import errors, params
from qmill.server.calibrator import expiry as expiry_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
    id: str
    tenant: str
    # What the stats belong to; a continuation must name the same (stats of another model or other
    # rules would not merge meaningfully).
    model_key: str
    rules_key: str
    batches: int
    examples: int
    # Nested dict of numpy arrays (the quant_stats collection).
    stats: dict[str, Any]
    # Statistic path ('<module>/<op>_<side>') -> the act qtype of its static scale, so that
    # QuantizeParams can turn the stats into PTQ scales by calibration id alone.
    stat_qtypes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # Statistic path -> the PTQ statistic paths its static scale is for, where not just its own
    # (an ODML calibration's names follow the reference's: engine/providers/odml_names.py).
    stat_aliases: Mapping[str, Sequence[str]] = dataclasses.field(default_factory=dict)


def _host_leaves(tree: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """{path: numpy array} of a stats tree (a boxed leaf gives its value)."""
    return {k: np.asarray(getattr(v, "value", v)) for k, v in params.flatten(tree).items()}


def _not_found(calibration_id: str) -> errors.NotFound:
    return errors.NotFound(f"calibration {calibration_id!r} not found")


class CalibrationStore:
    """Thread-safe; blocking (call it from an executor)."""

    def __init__(
        self, root: str | os.PathLike[str], *, expiry: expiry_lib.Expiry | None = None
    ) -> None:
        self.root = pathlib.Path(root)
        # When an unused calibration is swept (the language models' beside it use the same).
        self.expiry = expiry or expiry_lib.Expiry()
        self._tombstones = expiry_lib.Tombstones(self.root, self.expiry)
        self._lock = threading.Lock()

    @staticmethod
    def new_id() -> str:
        return secrets.token_hex(12)

    def _paths(self, calibration_id: str) -> tuple[pathlib.Path, pathlib.Path]:
        if not calibration_id or any(c not in "0123456789abcdef" for c in calibration_id):
            raise _not_found(calibration_id)
        return self.root / f"{calibration_id}.json", self.root / f"{calibration_id}.npz"

    def _meta(self, tenant: str, calibration_id: str) -> dict[str, Any]:
        """The calibration's record, checked: unknown, another tenant's or expired ids raise
        errors.NotFound. Call under the lock."""
        meta_path, _ = self._paths(calibration_id)
        try:
            meta = json.loads(meta_path.read_text())
        except FileNotFoundError:
            self._tombstones.check(tenant, calibration_id)
            raise _not_found(calibration_id) from None
        if meta["tenant"] != tenant:
            raise _not_found(calibration_id)
        if self.expiry.expired(meta_path):  # not swept yet: as if it were
            raise self.expiry.error(calibration_id)
        return meta

    def load(self, tenant: str, calibration_id: str) -> Calibration:
        """The calibration, its use recorded (its expiry starts again).

        Raises:
          errors.NotFound: an unknown id, another tenant's, or an expired one (saying so).
        """
        meta_path, npz_path = self._paths(calibration_id)
        with self._lock:
            meta = self._meta(tenant, calibration_id)
            try:
                with np.load(npz_path, allow_pickle=False) as npz:
                    flat = {name: npz[name] for name in meta["order"]}
            except FileNotFoundError:
                raise _not_found(calibration_id) from None
            self.expiry.touch(meta_path)
        return Calibration(
            id=calibration_id,
            tenant=tenant,
            model_key=meta["model_key"],
            rules_key=meta["rules_key"],
            batches=meta["batches"],
            examples=meta["examples"],
            stats=params.unflatten(flat),
            stat_qtypes=meta.get("stat_qtypes", {}),
            stat_aliases=meta.get("stat_aliases", {}),
        )

    # The name other modules use: get(tenant, id) -> Calibration.
    get = load

    def save(self, cal: Calibration) -> None:
        meta_path, npz_path = self._paths(cal.id)
        flat = _host_leaves(cal.stats)
        buffer = io.BytesIO()
        # Positional names would lose the paths; npz keys keep them ('/' is fine in a zip name).
        np.savez(buffer, **flat)
        meta = {
            "tenant": cal.tenant,
            "model_key": cal.model_key,
            "rules_key": cal.rules_key,
            "batches": cal.batches,
            "examples": cal.examples,
            "order": list(flat),
            "stat_qtypes": dict(cal.stat_qtypes),
            "stat_aliases": {k: list(v) for k, v in cal.stat_aliases.items()},
        }
        with self._lock:
            self.root.mkdir(parents=True, exist_ok=True)
            for path, data in (
                (npz_path, buffer.getvalue()),
                (meta_path, json.dumps(meta).encode()),
            ):
                files.write_durably(path, data)
            self.expiry.touch(meta_path)
            # Swept while a continuation ran (a sweep between its load and this save).
            self._tombstones.lift(cal.id)

    def load_stats(self, tenant: str, calibration_id: str) -> dict[str, Any]:
        """For the ODML exporter's Backends: only the stats (errors.NotFound is a LookupError)."""
        return self.load(tenant, calibration_id).stats

    def sweep(self) -> int:
        """Removes the calibrations unused for longer than the expiry (and statistics whose
        record a crash between the two writes of `save` never wrote); returns how many."""
        removed = 0
        with self._lock:
            for meta_path in self.root.glob("*.json"):
                if not self.expiry.expired(meta_path):
                    continue
                try:
                    tenant = json.loads(meta_path.read_text())["tenant"]
                except (OSError, ValueError, KeyError):
                    tenant = ""  # a torn record: nobody's to be told of
                meta_path.with_suffix(".npz").unlink(missing_ok=True)
                meta_path.unlink(missing_ok=True)
                self._tombstones.bury(meta_path.stem, tenant)
                removed += 1
            for npz_path in self.root.glob("*.npz"):
                if not npz_path.with_suffix(".json").exists() and self.expiry.expired(npz_path):
                    npz_path.unlink(missing_ok=True)
            self._tombstones.sweep()
        return removed
