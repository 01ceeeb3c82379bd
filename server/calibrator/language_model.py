"""CalibrateLanguageModel: a Hugging Face causal-LM folder calibrated layer by layer (GPTQ) on the
server, for `qmill quantize FOLDER --server HOST:PORT --method gptq`.

Design: the client uploads the folder's weight files (Uploads: resumable, crc'd, named by their
sha256, so a file the server holds is not sent again) and sends config.json, the recipe and the
token ids in the request. The server lays out the folder again under its data dir (config.json
and links to the uploaded files) and runs the CLI's own calibration on it
(checkpoints/lm/calibration.py), so memory is what the in-process run holds (one layer, the
hidden states, one Hessian) and the results are its results. They stay on the server under a
calibration id; QuantizeParams with that id (static_ranges.calibration_id) answers the
calibrated linears with them and quantizes every other tensor as usual, so the client's
pipeline writes the same bytes as in process. The id is a hash of the request (and tenant): a
call repeated after an interruption finds the layers kept by the last one and resumes after
them.

Layout: ``<root>/<id>/`` holds ``tenant``, ``source/`` (the folder, while the calibration runs:
it is laid out again by each call) and the kept calibration ``out.qmill-calibration/``
(lm_calibration's; once finished, its layers' results and ``done``, the call's summary: the
hidden states kept to resume are dropped). The server's disk holds the weight files once (the
uploads). A calibration
unused for the server's expiry (expiry.py; the stamp of its last use is ``tenant``) is swept,
unless a call is running it or reading its results.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import secrets
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from qmill.checkpoints.base import files as files_lib
from qmill.checkpoints.lm import calibration as lm_calibration
from qmill.checkpoints.lm import methods as lm_methods
from qmill.checkpoints.lm import work as lm_work
from qmill.proto import recipe as recipe_proto
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import codec, errors
from qmill.server.calibrator import expiry as expiry_lib

# Language-model calibration ids start with this; other ids are Calibrate's.
PREFIX = "lm-"
_FILE = re.compile(r"^[\w.-]+\.safetensors$")
_ID = re.compile(PREFIX + r"[0-9a-f]{32}")
# In the kept work once finished: the call's summary (JSON; empty from older servers).
_DONE = "done"
# A swept calibration's directory is renamed to this prefix (its id gone at once), then removed.
_REMOVING = ".removing-"


@dataclasses.dataclass(frozen=True)
class Done:
    """What a call gives back (CalibrateLanguageModelSummary)."""

    calibration_id: str
    report_json: str
    resumed_at_layer: int
    calibrated_tensors: list[str]
    # AWQ / SmoothQuant: name → the float tensor the folds changed (a norm, a bias).
    folded: dict[str, Any] = dataclasses.field(default_factory=dict)


def is_language_model(calibration_id: str) -> bool:
    return calibration_id.startswith(PREFIX)


def beside(calibrations: Any) -> LmCalibrations:
    """The language-model calibrations kept beside a CalibrationStore's (`root/language-models`),
    with its expiry. A server makes one and shares it between its services: what is running or
    being read is known to that one alone."""
    return LmCalibrations(calibrations.root / "language-models", expiry=calibrations.expiry)


class LmCalibrations:
    """The language-model calibrations of one server, under `root`. Blocking: call it from an
    executor."""

    def __init__(
        self, root: str | os.PathLike[str], *, expiry: expiry_lib.Expiry | None = None
    ) -> None:
        self.root = pathlib.Path(root)
        self._expiry = expiry or expiry_lib.Expiry()
        self._tombstones = expiry_lib.Tombstones(self.root, self._expiry)
        # Calibrations running now: a second call with the same request would share their
        # directory, so it is refused until the first ends; never swept.
        self._running: set[str] = set()
        # Calibrations whose results a call is reading (QuantizeParams loads each tensor's as
        # it comes): never swept while read.
        self._readers: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def _directory(self, tenant: str, calibration_id: str) -> pathlib.Path:
        base = self.root / calibration_id
        if not _ID.fullmatch(calibration_id):
            raise errors.NotFound(f"calibration {calibration_id!r} not found")
        owner = base / "tenant"
        if not owner.is_file() or owner.read_text() != tenant:
            self._tombstones.check(tenant, calibration_id)
            raise errors.NotFound(f"calibration {calibration_id!r} not found")
        if calibration_id not in self._running and self._expiry.expired(owner):
            raise self._expiry.error(calibration_id)  # not swept yet: as if it were
        return base

    def results(self, tenant: str, calibration_id: str) -> dict[str, Callable[[], Any]]:
        """Tensor name → a loader of its LeafResult, for QuantizeParams (which reads them inside
        `in_use`); its use is recorded (its expiry starts again).

        Raises:
          errors.NotFound: an unknown id, another tenant's, an expired one, or one whose
            calibration is not finished.
        """
        base = self._directory(tenant, calibration_id)
        work = lm_calibration.work_directory(base / "out")
        results = dict(lm_work.results_of(work))
        if not (work / _DONE).is_file():
            raise errors.NotFound(
                f"calibration {calibration_id!r} is not finished: call CalibrateLanguageModel "
                "again with the same request to finish it"
            )
        self._expiry.touch(base / "tenant")
        return results

    @contextlib.contextmanager
    def in_use(self, calibration_id: str) -> Iterator[None]:
        """While inside, the calibration is not swept (its results are being read)."""
        with self._lock:
            self._readers[calibration_id] += 1
        try:
            yield
        finally:
            with self._lock:
                self._readers[calibration_id] -= 1
                if not self._readers[calibration_id]:
                    del self._readers[calibration_id]

    def sweep(self) -> int:
        """Removes the calibrations unused for longer than the expiry, but those running or
        being read; returns how many."""
        with self._lock:
            doomed = [
                (base, _tenant(base))
                for base in (self.root.iterdir() if self.root.is_dir() else ())
                if _ID.fullmatch(base.name)
                and base.name not in self._running
                and base.name not in self._readers
                and self._expiry.expired(_stamp(base))
            ]
            for base, tenant in doomed:
                # Renamed under the lock (the id is gone at once), removed after it: a large
                # calibration's hidden states take a while to delete.
                base.rename(base.with_name(f"{_REMOVING}{base.name}-{secrets.token_hex(4)}"))
                self._tombstones.bury(base.name, tenant)
            self._tombstones.sweep()
        for left in self.root.glob(_REMOVING + "*"):  # this sweep's, and a crashed one's
            shutil.rmtree(left, ignore_errors=True)
        return len(doomed)

    def calibrate(
        self,
        tenant: str,
        request: pb.CalibrateLanguageModelRequest,
        content_path: Callable[[str, str], pathlib.Path],
        progress: Callable[[lm_calibration.LayerProgress], None],
        check: Callable[[], None],
    ) -> Done:
        """Runs (or resumes) the calibration a request asks for.

        Raises:
          ValueError: bad token ids or options, file names, an unsupported architecture,
            missing tensors.
          errors.NotFound / errors.FailedPrecondition: an unknown or incomplete upload.
        """
        lm_request, _ = codec.lm_options(request.calibration)
        lm_methods.check_recipe(lm_request.method, _recipe(request))
        if not request.weight_uploads:
            raise ValueError("weight_uploads is empty: upload the folder's .safetensors files")
        for name in request.weight_uploads:
            if not _FILE.match(name):
                raise ValueError(f"weight file name {name!r} must be NAME.safetensors, no folders")
        try:
            json.loads(request.config_json)
        except ValueError as e:
            raise ValueError(f"config_json is not JSON: {e}") from None
        # The uploads' contents (their files, named by sha256), not their ids: a file uploaded
        # again gets a new id, and must find the layers kept for the same bytes.
        files = {
            name: content_path(tenant, upload_id)
            for name, upload_id in request.weight_uploads.items()
        }
        calibration_id = _id(tenant, request, files)
        with self._lock:
            if calibration_id in self._running:
                raise errors.FailedPrecondition(
                    f"calibration {calibration_id} is running in another call with the same "
                    "request; call again once it ends (it resumes from the kept layers)"
                )
            self._running.add(calibration_id)
        try:
            return self._calibrate(
                tenant, request, calibration_id, lm_request, files, progress, check
            )
        finally:
            with self._lock:
                self._running.discard(calibration_id)

    def _calibrate(
        self,
        tenant: str,
        request: pb.CalibrateLanguageModelRequest,
        calibration_id: str,
        lm_request: lm_calibration.LmRequest,
        files: Mapping[str, pathlib.Path],
        progress: Callable[[lm_calibration.LayerProgress], None],
        check: Callable[[], None],
    ) -> Done:
        recipe = _recipe(request)
        base = self.root / calibration_id
        work = lm_calibration.work_directory(base / "out")
        finished = _finished(calibration_id, work)
        if finished is not None:  # a call repeated after its summary was lost
            self._expiry.touch(base / "tenant")
            return finished
        folder = _lay_out(base, tenant, request, files)
        self._expiry.touch(base / "tenant")
        with self._lock:
            self._tombstones.lift(calibration_id)  # swept before, made again
        cfg = lm_calibration.check_request(folder, lm_request)
        started: list[int] = []

        def on_layer(p: lm_calibration.LayerProgress) -> None:
            if not started:
                started.append(p.layer)
            progress(p)

        done = lm_calibration.calibrate(
            folder, base / "out", recipe, lm_request, progress=on_layer, check=check
        )
        summary = {
            "report_json": json.dumps(lm_calibration.report_fields(lm_request, done)),
            "calibrated_tensors": sorted(done.methods),
            "layers": cfg.num_layers,
        }
        files_lib.write_durably(work / _DONE, json.dumps(summary).encode())
        # Finished, it is read from its layers' results and this summary alone: the hidden
        # states kept to resume (samples × tokens × hidden float32, and the evaluation's two
        # streams: the bulk of it) and the folder laid out for the run (links to the uploads)
        # go. A repeated call returns the summary (_finished).
        lm_work.drop_state(work)
        shutil.rmtree(folder, ignore_errors=True)
        self._expiry.touch(base / "tenant")  # a use ends here: the expiry counts from now
        return Done(
            calibration_id=calibration_id,
            report_json=summary["report_json"],
            resumed_at_layer=started[0] if started else cfg.num_layers,
            calibrated_tensors=summary["calibrated_tensors"],
            folded={name: load() for name, load in sorted(done.folded.items())},
        )


def _finished(calibration_id: str, work: pathlib.Path) -> Done | None:
    """A finished calibration's Done, from the summary it kept (None: not finished, or
    finished by a server that kept none: it is resumed from its hidden states as before)."""
    try:
        summary = json.loads((work / _DONE).read_text())
        report_json, tensors, layers = (
            summary["report_json"],
            summary["calibrated_tensors"],
            summary["layers"],
        )
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return Done(
        calibration_id=calibration_id,
        report_json=report_json,
        resumed_at_layer=layers,
        calibrated_tensors=tensors,
        folded={name: load() for name, load in sorted(lm_work.folded_of(work).items())},
    )


def _stamp(base: pathlib.Path) -> pathlib.Path:
    """The file whose modification time is the calibration's last use: `tenant`, or the
    directory itself where a call ended before writing it."""
    owner = base / "tenant"
    return owner if owner.exists() else base


def _tenant(base: pathlib.Path) -> str:
    try:
        return (base / "tenant").read_text()
    except OSError:
        return ""


def _recipe(request: pb.CalibrateLanguageModelRequest) -> dict[str, Any]:
    """The request's recipe as a mapping, its convention the source format's unless it sets
    one (as SubmitJob does)."""
    recipe = recipe_proto.to_mapping(request.recipe)
    if recipe.get("convention") == "auto":
        del recipe["convention"]
    return recipe


def _id(
    tenant: str, request: pb.CalibrateLanguageModelRequest, files: Mapping[str, pathlib.Path]
) -> str:
    """A hash of the tenant, the request and the weight files' contents."""
    same = pb.CalibrateLanguageModelRequest()
    same.CopyFrom(request)
    same.weight_uploads.clear()
    same.weight_uploads.update({name: path.name for name, path in files.items()})
    digest = hashlib.sha256(tenant.encode() + b"\0")
    digest.update(same.SerializeToString(deterministic=True))
    return PREFIX + digest.hexdigest()[:32]


def _lay_out(
    base: pathlib.Path,
    tenant: str,
    request: pb.CalibrateLanguageModelRequest,
    files: Mapping[str, pathlib.Path],
) -> pathlib.Path:
    """The folder again: config.json, the index, and a link to each uploaded weight file."""
    folder = base / "source"
    folder.mkdir(parents=True, exist_ok=True)
    (base / "tenant").write_text(tenant)
    (folder / "config.json").write_text(request.config_json)
    if request.index_json:
        (folder / "model.safetensors.index.json").write_text(request.index_json)
    for name, path in files.items():
        link = folder / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(path)
    return folder


def quantizer(loaders: Mapping[str, Callable[[], Any]]) -> Callable[[Any, Any], Any]:
    """QuantizeParams' quantize function for a language-model calibration id: the kept result
    of a calibrated linear, round to nearest for every other tensor (as embedded.py does in
    process)."""
    from qmill.engine.modelfree import leaf

    def quantize(array: Any, plan: Any) -> Any:
        load = loaders.get(plan.path)
        return leaf.quantize_leaf(array, plan) if load is None else load()

    return quantize
