"""The kept calibration of a language model (checkpoints/lm_calibration.py), on disk beside
the destination: meta.json (what it was made with), one npz of results per finished layer with
a line in layers.jsonl, and state.npz (the hidden states after the last), so that a killed run
resumes at the next layer with the same bytes.

What it was made with includes the code that made it (`code_version`): kept layers of another
qmill are discarded, with a notice, rather than resumed, since a run mixing the layers of two
versions would give bytes neither version gives.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import pathlib
import shutil
from collections.abc import Callable, Iterator, Mapping
from importlib import metadata
from typing import Any

import numpy as np

from qmill.checkpoints.base import files

log = logging.getLogger(__name__)

_META = "meta.json"
_STATE = "state.npz"
# Key prefix of the folded float tensors in a layer's npz (beside NAME/qvalue, NAME/scale).
_FOLDED = "folded/"
# The fingerprint's key for the code that made the kept work (code_version).
_CODE = "code"
# The sources a kept layer's numbers come from, as (package, folder inside it): all of the engine
# (the forward pass and calibration in engine/lm, GPTQ and the folds in engine/contrib, the
# quantizers in engine/modelfree and engine/core), the calibration driver (checkpoints/lm) and
# what decides each linear's plan (the run's plan, the compressed-tensors schemes). Wider than
# strictly needed: an upgrade that changed none of the numbers costs a recomputation, where a
# narrower list could resume with mixed layers.
_SOURCES = (
    ("qmill.engine", ""),
    ("qmill.checkpoints", "lm"),
    ("qmill.checkpoints", "run"),
    ("qmill.checkpoints", "formats/compressed_tensors"),
)


@dataclasses.dataclass
class Streams:
    """The hidden states entering layer `next_layer`: calibration, the evaluation's float and
    quantized streams (None without evaluation windows), and QEP's float calibration stream
    (None for other methods)."""

    next_layer: int
    hidden: tuple
    source: tuple | None = None
    quantized: tuple | None = None
    eval_ids: tuple | None = None
    reference: tuple | None = None

    def take_hidden(self) -> tuple:
        """The calibration's hidden states, no longer held here (a layer replaces them chunk
        by chunk: holding them too would keep a second set alive)."""
        hidden, self.hidden = self.hidden, ()
        return hidden

    def take_reference(self) -> tuple:
        """QEP's float stream, no longer held here (as take_hidden)."""
        reference, self.reference = self.reference, None
        return reference or ()


@functools.cache
def code_version() -> str:
    """A digest of qmill's version and of the sources a kept layer's numbers come from
    (_SOURCES), computed once per process (~800 kB of source: ~15 ms). Not the version alone:
    it has stayed 0.1.0 through every change of the calibration code, so an upgrade would not
    change it.

    Raises:
      RuntimeError: a listed source folder is missing (moved: update _SOURCES).
    """
    digest = hashlib.sha256(metadata.version("qmill").encode() + b"\0")
    for package, part in _SOURCES:
        spec = importlib.util.find_spec(package)  # found, not imported: no jax here
        root = pathlib.Path(spec.submodule_search_locations[0]) if spec else None
        if root is None or not (root / part).is_dir():
            raise RuntimeError(f"code_version: {package} has no folder {part!r}; update _SOURCES")
        for path in sorted((root / part).rglob("*.py")):
            digest.update(f"{package}/{path.relative_to(root).as_posix()}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class Work:
    """The kept calibration: meta.json (what it was made with), one npz of results per finished
    layer with a line in layers.jsonl, and state.npz (the hidden states after the last)."""

    def __init__(
        self,
        directory: pathlib.Path,
        fingerprint: dict,
        restart: bool,
        *,
        notice: Callable[[str], None] | None = None,
    ) -> None:
        """`fingerprint`: what the work is made with (JSON); the code's version is added here.
        `notice` gets one line when kept work of another qmill is discarded (None: this
        module's logger, at INFO).

        Raises:
          ValueError: the directory holds work made with another fingerprint (pass restart).
        """
        self.directory = directory
        self.resumed_at = 0
        # The state after a layer is written while the next layer computes (75 MB at 64 x 512
        # tokens: ~0.2 s a layer otherwise); one write at a time, in layer order.
        self._writer = concurrent.futures.ThreadPoolExecutor(1, "qmill-lm-state")
        self._writing: concurrent.futures.Future | None = None
        wanted = json.loads(json.dumps({**fingerprint, _CODE: code_version()}))
        if restart or _kept_by_other_code(directory, wanted, notice or log.info):
            shutil.rmtree(directory, ignore_errors=True)
        meta = directory / _META
        if meta.is_file():
            if json.loads(meta.read_text()) != wanted:
                raise ValueError(
                    f"{directory} holds a calibration made with another source, recipe, "
                    "tokens or GPTQ options; pass --restart to discard it"
                )
        else:
            directory.mkdir(parents=True, exist_ok=True)
            files.write_durably(meta, json.dumps(wanted, indent=1).encode())

    def resume(self) -> Streams | None:
        path = self.directory / _STATE
        if not path.is_file():
            return None
        import jax.numpy as jnp  # here: no state, no need of jax

        with np.load(path) as state:

            def chunks(key: str) -> tuple | None:
                names = sorted(n for n in state.files if n.startswith(key + "/"))
                return tuple(jnp.asarray(state[n]) for n in names) or None

            streams = Streams(
                int(state["next_layer"]),
                chunks("hidden"),
                chunks("source"),
                chunks("quantized"),
                chunks("eval_ids"),
                chunks("reference"),
            )
        self.resumed_at = streams.next_layer
        return streams

    def finish_layer(self, layer: int, done: Any, seconds: float, streams: Streams) -> None:
        """Keeps a layer: its results, then its log line, then the state after it (a kill in
        between redoes the layer, which gives the same bytes)."""
        arrays: dict[str, np.ndarray] = {}
        for name, result in done.results.items():
            arrays[f"{name}/qvalue"] = result.qvalue
            arrays[f"{name}/scale"] = _storable(result.scale)
            if result.zero_point is not None:
                arrays[f"{name}/zero_point"] = _storable(result.zero_point)
        for name, array in done.folded.items():  # AWQ / SmoothQuant's folded norms and biases
            arrays[f"{_FOLDED}{name}"] = _storable(array)
        _save_npz_atomic(self.directory / f"layer-{layer:05d}.npz", arrays)
        line = {
            "layer": layer,
            "seconds": round(seconds, 3),
            "loss": layer_loss(done),
            "losses": done.losses,
            "tensors": {
                name: {
                    "dtype": [np.dtype(r.scale.dtype).name, np.dtype(r.qvalue.dtype).name]
                    + ([np.dtype(r.zero_point.dtype).name] if r.zero_point is not None else []),
                    "packed_as": None
                    if r.packed_as is None
                    else [np.dtype(r.packed_as[0]).name, list(r.packed_as[1])],
                    "sqnr_db": r.quality.sqnr_db,
                    "mean_relative_error": r.quality.mean_relative_error,
                }
                | ({"rtn": done.rtn[name]} if name in getattr(done, "rtn", {}) else {})
                for name, r in done.results.items()
            },
        }
        if done.folded or done.methods or done.smoothing:  # lines of a GPTQ run stay as they were
            line["folded"] = {name: np.dtype(a.dtype).name for name, a in done.folded.items()}
            line["methods"] = done.methods
            line["smoothing"] = done.smoothing
        with open(self.directory / "layers.jsonl", "a") as log:
            log.write(json.dumps(line) + "\n")
            log.flush()
            os.fsync(log.fileno())
        state = {"next_layer": np.int64(streams.next_layer)}
        for key in ("hidden", "source", "quantized", "eval_ids", "reference"):
            value = getattr(streams, key)
            # Chunk by chunk: no concatenated copy of every sample's hidden states.
            for i, chunk in enumerate(value or ()):
                state[f"{key}/{i:05d}"] = chunk
        self.wait()
        self._writing = self._writer.submit(_save_npz_atomic, self.directory / _STATE, state)

    def __enter__(self) -> Work:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        """Leaves no write in flight: a caller that then discards the directory (a cancelled
        job) must not race the last state's write into it. A failed write is raised unless the
        block is already raising."""
        try:
            if kind is None:
                self.wait()
            else:
                with contextlib.suppress(Exception):
                    self.wait()
        finally:
            self._writer.shutdown(wait=True)

    def wait(self) -> None:
        """Returns once the last layer's state is on disk (raises what writing it raised).
        A kill before then resumes at that layer, as a kill before finish_layer would. Leaving
        the `with` block waits too: readers of the kept work (layers, methods) run after it."""
        writing, self._writing = self._writing, None
        if writing is not None:
            writing.result()

    def layers(self) -> list[dict[str, Any]]:
        keep = ("layer", "loss", "seconds", "losses", "smoothing")
        return [{k: e[k] for k in keep if k in e} for _, e in sorted(_log(self.directory).items())]

    def methods(self) -> dict[str, str]:
        """Calibrated tensor → its method ("gptq", "awq", "smoothquant+gptq", "rtn", ...)."""
        return {
            name: "rtn" if "rtn" in info else e.get("methods", {}).get(name, "gptq")
            for e in _log(self.directory).values()
            for name, info in e["tensors"].items()
        }

    def rtn(self) -> dict[str, str]:
        """Tensor name → why it was quantized round to nearest (no token reached it)."""
        return {
            name: info["rtn"]
            for e in _log(self.directory).values()
            for name, info in e["tensors"].items()
            if "rtn" in info
        }


def drop_state(directory: pathlib.Path) -> None:
    """Removes the hidden states kept after the last layer (the bulk of the kept work) once
    nothing will resume from them: a finished calibration kept with its outcome (the
    server's). Its layers' results stay readable (results_of, folded_of)."""
    (directory / _STATE).unlink(missing_ok=True)


def _kept_by_other_code(
    directory: pathlib.Path, wanted: Mapping[str, Any], notice: Callable[[str], None]
) -> bool:
    """Whether `directory` holds work made with the same arguments by another qmill (or by one
    from before the code entered the fingerprint): its layers cannot be trusted to match the
    ones this code computes, so it is started over, which the user is told of, not asked.
    Work made with other arguments is Work's ValueError, as it was."""
    meta = directory / _META
    if not meta.is_file():
        return False
    kept = json.loads(meta.read_text())
    other = {k: v for k, v in kept.items() if k != _CODE}
    if kept.get(_CODE) == wanted[_CODE] or other != {k: v for k, v in wanted.items() if k != _CODE}:
        return False
    notice(
        f"{directory} was kept by another version of qmill; its layers cannot be mixed with "
        "this version's, so the calibration starts over"
    )
    return True


def _log(directory: pathlib.Path) -> dict[int, dict[str, Any]]:
    """layers.jsonl: layer → its line (a redone layer: its last line)."""
    log = directory / "layers.jsonl"
    if not log.is_file():
        return {}
    lines = {}
    for text in log.read_text().splitlines():
        if text.strip():
            entry = json.loads(text)
            lines[entry["layer"]] = entry
    return lines


def results_of(directory: pathlib.Path) -> Iterator[tuple[str, Callable[[], Any]]]:
    """(tensor name, a loader of its LeafResult) for every calibrated linear kept in
    `directory`."""
    for layer, entry in _log(directory).items():
        for name, info in entry["tensors"].items():
            yield name, _loader(directory / f"layer-{layer:05d}.npz", name, info)


def layer_loss(done: Any) -> float:
    """A layer's number for its log and progress lines: GPTQ's loss summed over its linears, or
    without GPTQ the block-output errors AWQ reached (0 for SmoothQuant alone)."""
    if done.losses:
        return float(sum(done.losses.values()))
    return float(sum(fold.get("error", 0.0) for fold in done.smoothing))


def folded_of(directory: pathlib.Path) -> dict[str, Callable[[], np.ndarray]]:
    """Tensor name → a loader of the float tensor a fold changed (a norm, a bias; in its own
    dtype), which the output holds in place of the source's."""
    out = {}
    for layer, entry in _log(directory).items():
        for name, dtype in entry.get("folded", {}).items():
            out[name] = _folded_loader(directory / f"layer-{layer:05d}.npz", name, dtype)
    return out


def _folded_loader(path: pathlib.Path, name: str, dtype: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        with np.load(path) as stored:
            return _restore(stored[_FOLDED + name], dtype)

    return load


def _storable(a: np.ndarray) -> np.ndarray:
    """An array np.save keeps as it is: ml_dtypes' types (bfloat16, float8, int4) as raw ints
    of their width; layers.jsonl records the dtype to view them back as."""
    a = np.asarray(a)
    if a.dtype.kind == "V" or type(a.dtype).__module__.startswith("ml_dtypes"):
        return a.view(f"u{a.dtype.itemsize}")
    return a


def _restore(a: np.ndarray, dtype: str) -> np.ndarray:
    import ml_dtypes  # noqa: F401  (registers the names np.dtype looks up)

    want = np.dtype(dtype)
    return a if a.dtype == want else a.view(want)


def _loader(path: pathlib.Path, name: str, info: Mapping[str, Any]) -> Callable[[], Any]:
    def load() -> Any:
        from qmill.engine.modelfree import leaf

        with np.load(path) as stored:
            scale = _restore(stored[f"{name}/scale"], info["dtype"][0])
            qvalue = _restore(stored[f"{name}/qvalue"], info["dtype"][1])
            zero_point = None
            if f"{name}/zero_point" in stored.files:
                zero_point = _restore(stored[f"{name}/zero_point"], info["dtype"][2])
        packed = info["packed_as"]
        return leaf.LeafResult(
            qvalue=qvalue,
            scale=scale,
            zero_point=zero_point,
            quality=leaf.Quality(info["sqnr_db"], info["mean_relative_error"]),
            packed_as=None if packed is None else (np.dtype(packed[0]), tuple(packed[1])),
        )

    return load


def _save_npz_atomic(path: pathlib.Path, arrays: Mapping[str, np.ndarray]) -> None:
    """An npz written straight to a temporary file, synced and renamed into place (no copy of
    the whole archive in memory: the state holds every sample's hidden states)."""
    with files.replacing(path) as f:
        np.savez(f, **{k: _storable(v) for k, v in arrays.items()})


def tokens_digest(*token_ids: np.ndarray | None) -> str:
    """What a kept work's fingerprint says of its token ids: their int32 bytes and shapes."""
    digest = hashlib.sha256()
    for ids in token_ids:
        if ids is not None:
            digest.update(np.ascontiguousarray(ids, np.int32).tobytes())
            digest.update(str(ids.shape).encode())
    return digest.hexdigest()


def canonical_recipe(recipe: Mapping[str, Any]) -> Any:
    """The recipe as a kept work's fingerprint holds it (JSON, keys sorted)."""
    return json.loads(json.dumps(recipe, sort_keys=True, default=str))
