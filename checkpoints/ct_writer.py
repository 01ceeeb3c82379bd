"""`--format compressed-tensors`: the checkpoint vLLM, SGLang and transformers load.

The engine quantizes as for any output (the scheme's rule, ct_schemes); this writer stores each
quantized weight in compressed-tensors' layout (ct_layout) instead of the Qwix one, and the
folder's config.json gets compressed-tensors' `quantization_config` (ct_schemes), whose
`ignore` names the Linear weights left in float. Every other file of a Hugging Face folder is
copied as HfFolderWriter copies it. A safetensors file or set without a folder around it gets the
same tensors, the config in its `__metadata__["quantization_config"]` (JSON).

`check_source` refuses, before any tensor is read, what compressed-tensors cannot hold.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import numpy as np

from qmill.checkpoints import (
    ct_activations,
    ct_blocks,
    ct_global,
    ct_layout,
    ct_schemes,
    hf_folder,
    safetensors_writer,
    staging,
    writer_base,
)

METADATA_KEY = "quantization_config"


def check_source(source: Any, recipe: dict[str, Any]) -> ct_schemes.Scheme:
    """The recipe's scheme, once every tensor it quantizes fits compressed-tensors.

    Raises:
        ValueError: the source is not a PyTorch-layout safetensors checkpoint, is already
            quantized, the recipe is no scheme's, or a tensor the scheme would quantize is not
            a 2-D `<module>.weight` or its groups or blocks do not divide it; the message says
            what to do instead.
    """
    from qmill.engine.modelfree import layout, recipes  # lazy: pulls in jax

    if source.format != "safetensors":
        raise ValueError(
            f"compressed-tensors output needs a safetensors checkpoint in the PyTorch layout (a "
            f"Hugging Face folder or .safetensors); this {source.format} checkpoint holds Flax "
            "kernels (in, out): save the model as a Hugging Face folder first, or write "
            "--format safetensors/orbax"
        )
    if recipe.get("convention", "torch") != "torch":
        raise ValueError(
            "compressed-tensors weights are PyTorch Linear weights (out, in): drop the recipe's "
            f"convention {recipe['convention']!r} or set it to 'torch'"
        )
    if getattr(source, "has_config", True) is False:
        raise ValueError(
            f"{source.folder} has no config.json: vLLM and transformers read a "
            "compressed-tensors model's scheme from it, so the output would load as nothing. "
            "Put the model's config.json (from where the model came) in the folder and run "
            "again"
        )
    config = getattr(source, "config", {})
    if isinstance(config, dict) and "quantization_config" in config:
        method = (config["quantization_config"] or {}).get("quant_method", "unknown")
        raise ValueError(
            f"{source.folder} is already quantized (quant_method {method!r}); quantize the "
            "float model instead"
        )
    scheme = ct_schemes.scheme_of_recipe(recipe)
    engine_recipe = recipes.recipe_from_mapping(recipe)
    padded = ct_blocks.padded_entries(source.entries(), recipe)
    for entry in source.entries():
        entry = padded.get(entry.path, entry)
        try:
            plan = layout.plan_leaf(entry.path, entry.shape, entry.dtype, engine_recipe)
        except ValueError as e:
            raise ValueError(
                f"{e}. {scheme.name} needs the groups/blocks to divide each weight: leave this "
                "tensor in float with a skip rule before the scheme's in a recipe file, or "
                "choose a per-channel scheme (W8A8, FP8_DYNAMIC)"
            ) from None
        if plan.quantize and (len(entry.shape) != 2 or not entry.path.endswith(".weight")):
            raise ValueError(
                f"{entry.path} (shape {list(entry.shape)}) would be quantized, but "
                "compressed-tensors stores only 2-D Linear `<module>.weight` tensors: leave it "
                "in float with a skip rule in a recipe file"
            )
    return scheme


# Statistic suffixes of the calibrated methods whose params carry a per-input-channel scale
# beside the codes (engine/contrib/leaf.py SUFFIXES; the client does not import the engine).
PER_CHANNEL_SCALE_SUFFIXES = {"_awq": "awq", "_sq": "smoothquant"}


def per_channel_scale_refusal(what: str, method: str) -> str:
    """Why `what` (a calibration, a tensor) quantized by `method` has no compressed-tensors
    output, and what to do instead."""
    return (
        f"{what}: {method} params carry a per-input-channel scale beside the codes (awq_scale / "
        "inv_sq_scale), which compressed-tensors cannot hold: its pack-quantized format has no "
        "per-input-channel scale, and llm-compressor folds AWQ scales into the previous layer, "
        "which a model-free service cannot do (it never sees the model's graph). Write qmill's "
        "layout instead (--format safetensors, npz or orbax; a Hugging Face folder stays one), "
        "or calibrate with --method gptq"
    )


def check_calibration(stat_keys: Any, what: str) -> None:
    """Refuses, before any work, statistics (flat '/'-joined keys, as `qmill calibrate
    --stats-output` writes them) of a method whose params compressed-tensors cannot hold."""
    for key in stat_keys:
        stat = str(key).rpartition("/")[0]
        for suffix, method in PER_CHANNEL_SCALE_SUFFIXES.items():
            if stat.endswith(suffix):
                raise ValueError(per_channel_scale_refusal(what, method))


LM_HEAD = "lm_head"
# transformers' PretrainedConfig ties the head to the input embedding unless a config says not.
_LANGUAGE_MODEL_SUFFIXES = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")


def _ties_lm_head(config: Any, paths: list[str]) -> bool:
    """Whether the model has an lm_head Linear whose weight is the (float) embedding's."""
    if not isinstance(config, dict) or f"{LM_HEAD}.weight" in paths:
        return False
    architectures = config.get("architectures") or []
    is_language_model = any(str(a).endswith(_LANGUAGE_MODEL_SUFFIXES) for a in architectures)
    return is_language_model and config.get("tie_word_embeddings", True) is not False


class _Layout:
    """What both writers share: the scheme, and the weights left in float."""

    def _setup(self, recipe: dict[str, Any] | None, source: Any) -> None:
        self._scheme = ct_schemes.scheme_of_recipe(recipe or {})
        self._global_scales = ct_global.global_scales(recipe or {})
        self._ignored: list[str] = []
        # Every tensor is stored at its source shape: what the engine saw zero-padded to whole
        # blocks (ct_blocks) is cut back to it, anything else is already that shape.
        self._shapes = {e.path: e.shape for e in source.entries()}
        self._scratch = np.empty(0, np.uint8)

    def _scratch_bytes(self, nbytes: int) -> np.ndarray:
        """A buffer ct_layout.compress makes int4 words in: reused, as every weight's words are
        written before the next weight is compressed."""
        if self._scratch.size < nbytes:
            self._scratch = np.empty(nbytes, np.uint8)
        return self._scratch[:nbytes]

    def _unpadded(self, path: str, array: Any) -> Any:
        shape = self._shapes.get(path)
        return array if shape is None else ct_blocks.unpad(array, shape)

    def check_parts(self, path: str, parts: dict[str, Any]) -> None:
        """Refuses an AWQ / SmoothQuant result, and a static-activation scheme's result without
        its input scale. A calibration id's method is known only on the server: its first such
        tensor stops the run here (the pipeline asks before it keeps the tensor for resuming;
        _compress asks again), and nothing is committed."""
        for name, method in writer_base.BESIDE_PARTS.items():
            if name in parts:
                raise ValueError(per_channel_scale_refusal(path, method))
        # A static-activation scheme's weight comes with its Linear's calibrated input scale.
        needed = ct_activations.input_part(self._scheme)
        if needed is not None and needed not in parts:
            raise ValueError(f"{path}: {ct_activations.needs_calibration(self._scheme)}")

    def _compress(self, path: str, parts: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.check_parts(path, parts)
        parts = {**parts, "qvalue": self._unpadded(path, parts["qvalue"])}
        return ct_layout.compress(
            self._scheme, path, parts, self._global_scales.get(path), scratch=self._scratch_bytes
        )

    def _note_kept(self, path: str, array: np.ndarray) -> np.ndarray:
        """The kept weight as stored (its own shape), noted in `ignore`."""
        array = self._unpadded(path, array)
        self._ignore_if_weight(path, array.ndim)
        return array

    def _ignore_if_weight(self, path: str, ndim: int) -> None:
        if ndim == 2 and path.endswith(".weight"):
            self._ignored.append(ct_layout.module_of(path))

    def _replay_kept(self, note: dict[str, Any]) -> None:
        """`_note_kept` of an entry an interrupted run wrote in place (staging.InPlace)."""
        if note["call"] == "source":
            self._ignore_if_weight(note["path"], len(note["shape"]))

    def _config(self) -> dict[str, Any]:
        return ct_schemes.quantization_config(self._scheme, sorted(self._ignored))


class FolderWriter(_Layout, hf_folder.HfFolderWriter):
    """A Hugging Face folder in, the same folder out with compressed-tensors weights."""

    def __init__(
        self,
        destination: str | os.PathLike,
        source: hf_folder.HfFolderSource,
        recipe: dict[str, Any] | None,
        *,
        overwrite: bool = False,
        in_place: staging.InPlace | None = None,
    ) -> None:
        self._setup(recipe, source)
        super().__init__(destination, source, recipe, overwrite=overwrite, in_place=in_place)
        # NVFP4: fused partners are stored in their primary's shard, as model_free_ptq does.
        self._homes: dict[str, str] = {}
        paths = [e.path for e in source.entries()]
        if self._scheme.format == ct_schemes.NVFP4:
            self._homes = ct_global.partner_homes(paths)
        if _ties_lm_head(getattr(source, "config", {}), paths):
            # The head is the float embedding under another name: compressed-tensors would
            # otherwise make the model's lm_head Linear a quantized one with no weights to load.
            self._ignored.append(LM_HEAD)

    def _replay(self, note: dict[str, Any]) -> None:
        self._replay_kept(note)
        super()._replay(note)

    def write(self, path: str, array: np.ndarray) -> None:
        super().write(path, self._note_kept(path, np.asarray(array)))

    def write_quantized(self, path: str, parts: dict[str, np.ndarray]) -> None:
        self._quantized[path] = np.dtype(parts["qvalue"].dtype).name
        for key, array in self._compress(path, parts).items():
            self._weights.write_as(key, array, self._homes.get(path, path))

    def _quantization_config(self, left_out: list[pathlib.Path]) -> dict[str, Any]:
        return self._config()


class FileWriter(_Layout):
    """A safetensors file (or set) out: the config goes in __metadata__."""

    def __init__(
        self,
        destination: str | os.PathLike,
        like: Any,
        recipe: dict[str, Any] | None,
        *,
        overwrite: bool = False,
        in_place: staging.InPlace | None = None,
    ) -> None:
        self._setup(recipe, like)
        self._weights = safetensors_writer.SafetensorsWriter(
            destination, like=like, overwrite=overwrite, in_place=in_place
        )
        for note in in_place.written if in_place is not None else ():
            self._replay_kept(note)

    def take_events(self) -> list[dict[str, Any]]:
        return self._weights.take_events()

    def write(self, path: str, array: np.ndarray) -> None:
        self._weights.write(path, self._note_kept(path, np.asarray(array)))

    def write_quantized(self, path: str, parts: dict[str, np.ndarray]) -> None:
        for key, array in self._compress(path, parts).items():
            self._weights.write_as(key, array, path)

    def commit(self) -> None:
        self._weights.set_metadata(METADATA_KEY, json.dumps(self._config(), sort_keys=True))
        self._weights.commit()

    def abort(self) -> None:
        self._weights.abort()

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def create(
    destination: str | os.PathLike,
    like: Any,
    recipe: dict[str, Any] | None,
    *,
    overwrite: bool = False,
    in_place: staging.InPlace | None = None,
) -> FolderWriter | FileWriter:
    """The writer for a compressed-tensors output of source `like` (see the module doc)."""
    if isinstance(like, hf_folder.HfFolderSource):
        if not str(destination).endswith(".safetensors"):
            return FolderWriter(destination, like, recipe, overwrite=overwrite, in_place=in_place)
        like = like.weights
    return FileWriter(destination, like, recipe, overwrite=overwrite, in_place=in_place)
