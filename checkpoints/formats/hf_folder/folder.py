"""Hugging Face model folders: `config.json` + `*.safetensors` (+ index) in, the same folder out.

A folder holding a `config.json` and safetensors weights is read as a safetensors checkpoint
(HfFolderSource); so is one with other files beside its weights but no config.json (a model
folder that lost it), whose files are copied all the same, with no config written. Written back
(HfFolderWriter), the output is the same folder: the weight files under their own names (shards
and index rewritten), every other file -- tokenizer files, `1_Pooling/`, READMEs -- copied byte
for byte, and `config.json` with a `quantization_config` that says how the weights were
quantized (quantization_config.build). Everything is staged beside
the destination and renamed into place at once, as every other output is.

Not copied: the source's safetensors files and index (rewritten), float weights in other formats
(`pytorch_model*.bin`, `tf_model*.h5`, `flax_model*.msgpack`, `*.onnx`: copies of the weights
that would stay unquantized; their names are recorded in the config's `qmill.not_copied`), and
the `.git` and `.cache` directories of a cloned or downloaded repository.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
from typing import Any

import ml_dtypes
import numpy as np

from qmill.checkpoints.base import dtypes, staging, writer_base
from qmill.checkpoints.formats.hf_folder import quantization_config
from qmill.checkpoints.formats.safetensors import source as safetensors_source
from qmill.checkpoints.formats.safetensors import writer as safetensors_writer

CONFIG = "config.json"
_SKIPPED_DIRS = frozenset({".git", ".cache"})
# Float weights in other formats: copying them would ship the unquantized model again.
_OTHER_WEIGHTS = re.compile(
    r"(pytorch_model.*\.bin|tf_model.*\.h5|flax_model.*\.msgpack|.*\.onnx(_data)?)"
)


def is_hf_folder(path: pathlib.Path) -> bool:
    """A directory with a config.json and safetensors weights beside it."""
    return (path / CONFIG).is_file() and any(path.glob("*.safetensors"))


def read_config(folder: pathlib.Path) -> dict[str, Any]:
    """The folder's config.json as a mapping.

    Raises:
        ValueError: config.json is not a JSON object.
    """
    try:
        config = json.loads((folder / CONFIG).read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{folder / CONFIG} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{folder / CONFIG} is not a JSON object")
    return config


class HfFolderSource:
    """A safetensors source that also knows the folder it came from (and its config)."""

    format = "safetensors"
    # Its reads are SafetensorsSource's (positional): the pipeline may write kept tensors as
    # their turn comes instead of after the last result (checkpoints/run/in_order.py).
    concurrent_reads = safetensors_source.SafetensorsSource.concurrent_reads

    def __init__(
        self,
        folder: pathlib.Path,
        weights: safetensors_source.SafetensorsSource,
        *,
        has_config: bool = True,
    ):
        """`has_config` False: a folder of weights and other files (tokenizer, README, ...)
        without a config.json, whose other files are copied all the same; it has no config to
        record the quantization in."""
        self.folder = folder
        self.weights = weights
        self.separator = weights.separator
        self.has_config = has_config
        try:
            self.config = read_config(folder) if has_config else {}
        except ValueError:
            weights.close()
            raise

    def entries(self) -> list[Any]:
        return self.weights.entries()

    def read(self, path: str) -> np.ndarray:
        return self.weights.read(path)

    def close(self) -> None:
        self.weights.close()

    def __enter__(self) -> HfFolderSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def weight_files(self) -> list[pathlib.Path]:
        """The files the weights come from: shards, and the index when there is one."""
        index = [self.weights.index] if self.weights.index is not None else []
        return [*self.weights.files, *index]

    def other_files(self) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
        """(files copied into the output, weight files in other formats left out), relative."""
        weights = {p.resolve() for p in self.weight_files()}
        copied, left_out = [], []
        # Symlinked sub-folders are followed: their files are part of the model as much.
        for root, dirs, names in os.walk(self.folder, followlinks=True):
            dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS)
            for name in sorted(names):
                path = pathlib.Path(root) / name
                if path.resolve() in weights or path.name.endswith(staging.PARTIAL_SUFFIX):
                    continue
                relative = path.relative_to(self.folder)
                (left_out if _OTHER_WEIGHTS.fullmatch(name) else copied).append(relative)
        return copied, left_out


def _is_kept_float(dtype: np.dtype, shape: Any) -> bool:
    """A float tensor of rank >= 2 written as it was (quantization_config's `ignore`):
    ml_dtypes' floats too (bfloat16, float8), which numpy's float check does not count."""
    if len(shape) < 2:
        return False
    try:
        ml_dtypes.finfo(dtype)
    except ValueError:
        return False
    return True


class HfFolderWriter:
    """Writes a quantized HfFolderSource as a folder of the same shape (see the module doc)."""

    def __init__(
        self,
        destination: str | os.PathLike,
        source: HfFolderSource,
        recipe: dict[str, Any] | None,
        *,
        overwrite: bool = False,
        in_place: staging.InPlace | None = None,
    ) -> None:
        if "quantization_config" in source.config:
            method = source.config["quantization_config"].get("quant_method", "unknown")
            raise ValueError(
                f"{source.folder} is already quantized (config.json has a quantization_config, "
                f"quant_method {method!r}); quantize the float model instead"
            )
        self._source = source
        self._recipe = recipe or {}
        self._out = staging.StagedOutput(destination, overwrite=overwrite)
        self._out.staging.mkdir()
        self._state = "open"
        self._quantized: dict[str, str] = {}  # path -> stored qvalue dtype
        self._beside: dict[str, int] = {}  # awq_scale / inv_sq_scale -> tensors that have one
        self._kept: list[str] = []  # float tensors of rank >= 2 written as they were
        files = source.weights.files
        # One unsharded file keeps its name; a sharded set is written to a directory first and
        # its shards renamed to the source's names afterwards.
        single = len(files) == 1 and source.weights.index is None
        self._weights_at = self._out.staging / (files[0].name if single else ".qmill-weights")
        try:
            self._weights = safetensors_writer.SafetensorsWriter(
                self._weights_at, like=source.weights, in_place=in_place
            )
        except BaseException:
            self._out.abort()
            raise
        for note in in_place.written if in_place is not None else ():
            self._replay(note)

    def _replay(self, note: dict[str, Any]) -> None:
        """What write / write_quantized noted of an entry an interrupted run wrote in place."""
        if note["call"] == "quantized":
            self._note_quantized(note["path"], note["parts"])
        elif _is_kept_float(dtypes.logical_dtype(note["dtype"]), note["shape"]):
            self._kept.append(note["path"])

    def _note_quantized(self, path: str, dtypes_by_part: dict[str, str]) -> None:
        self._quantized[path] = dtypes_by_part["qvalue"]
        for name in writer_base.BESIDE_PARTS:
            if name in dtypes_by_part:
                self._beside[name] = self._beside.get(name, 0) + 1

    def take_events(self) -> list[dict[str, Any]]:
        return self._weights.take_events()

    def write(self, path: str, array: np.ndarray) -> None:
        array = np.asarray(array)
        if _is_kept_float(array.dtype, array.shape):
            self._kept.append(path)
        self._weights.write(path, array)

    def write_quantized(self, path: str, parts: dict[str, np.ndarray]) -> None:
        self._note_quantized(path, {k: np.dtype(v.dtype).name for k, v in parts.items()})
        self._weights.write_quantized(path, parts)

    def commit(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"this checkpoint writer is already {self._state}")
        try:
            self._weights.commit()
            self._place_weights()
            copied, left_out = self._source.other_files()
            for relative in copied:
                if relative == pathlib.Path(CONFIG):
                    continue
                target = self._out.staging / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(self._source.folder / relative, target)  # follows symlinks
            if self._source.has_config:
                config = dict(self._source.config)
                config["quantization_config"] = self._quantization_config(left_out)
                # HF's own writer: two-space indent, keys in their order, a final newline.
                text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
                (self._out.staging / CONFIG).write_text(text, encoding="utf-8")
            self._out.commit()
        except BaseException:
            self.abort()
            raise
        self._state = "committed"

    def _quantization_config(self, left_out: list[pathlib.Path]) -> dict[str, Any]:
        """config.json's quantization_config (a writer of another layout says its own)."""
        return quantization_config.build(
            self._recipe,
            quantized=self._quantized,
            kept=self._kept,
            not_copied=[str(p) for p in left_out],
            beside=self._beside,
        )

    def _place_weights(self) -> None:
        """Moves a sharded output's shards and index up, under the source's file names."""
        if self._weights_at.suffix == ".safetensors":
            return
        written = sorted(self._weights_at.glob("*.safetensors"))
        sources = self._source.weights.files
        names = {w.name: s.name for w, s in zip(written, sources, strict=True)}
        for w in written:
            os.rename(w, self._out.staging / names[w.name])
        index_path = self._weights_at / safetensors_writer.INDEX_NAME
        if index_path.exists():
            index = json.loads(index_path.read_text())
            index["weight_map"] = {k: names[v] for k, v in index["weight_map"].items()}
            source_index = self._source.weights.index
            name = source_index.name if source_index else safetensors_writer.INDEX_NAME
            (self._out.staging / name).write_text(json.dumps(index, indent=2) + "\n")
            index_path.unlink()
        self._weights_at.rmdir()

    def abort(self) -> None:
        if self._state == "open":
            self._state = "aborted"
            self._weights.abort()
            self._out.abort()

    def __enter__(self) -> HfFolderWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if self._state != "open":
            return
        if exc_type is None:
            self.commit()
        else:
            self.abort()
