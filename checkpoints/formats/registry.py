"""Which format a path holds, and the reader or writer for it."""

from __future__ import annotations

import os
import pathlib
import re
from typing import Any

from qmill.checkpoints.base import files, protocols, staging
from qmill.checkpoints.formats.compressed_tensors import global_scales as ct_global
from qmill.checkpoints.formats.compressed_tensors import schemes as ct_schemes
from qmill.checkpoints.formats.compressed_tensors import writer as ct_writer
from qmill.checkpoints.formats.hf_folder import folder as hf_folder
from qmill.checkpoints.formats.npz import source as npz_source
from qmill.checkpoints.formats.npz import writer as npz_writer
from qmill.checkpoints.formats.orbax import layout as orbax_layout
from qmill.checkpoints.formats.orbax import source as orbax_source
from qmill.checkpoints.formats.orbax import writer as orbax_writer
from qmill.checkpoints.formats.safetensors import header as safetensors_header
from qmill.checkpoints.formats.safetensors import source as safetensors_source
from qmill.checkpoints.formats.safetensors import writer as safetensors_writer

FORMATS = ("orbax", "safetensors", "npz", "compressed-tensors")
COMPRESSED_TENSORS = "compressed-tensors"
_ACCEPTED = (
    "an Orbax PyTree checkpoint directory, a .safetensors file, a sharded safetensors set (its "
    "*.safetensors.index.json, or a directory holding one index or *.safetensors files), or an "
    ".npz file"
)
_ZIP_MAGIC = b"PK\x03\x04"
# A Hub model id as a user types it (meta-llama/Llama-3.1-8B): one slash, no path-like start.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# PyTorch's pickled weights: never opened (unpickling runs code), refused with the way out.
_PICKLES = re.compile(r".*\.(bin|pt|pth|ckpt)")


def _pickles_message(path: pathlib.Path, names: list[str]) -> str:
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return (
        f"{path} holds PyTorch pickled weights ({shown}), which qmill never opens (unpickling "
        "can run code): convert them to safetensors first (transformers: "
        "AutoModel.from_pretrained(FOLDER).save_pretrained(NEW_FOLDER) writes safetensors), or "
        "download the model's *.safetensors files instead"
    )


def open_source(path: str | os.PathLike) -> protocols.TensorSource:
    """Opens a checkpoint for reading tensor by tensor.

    Raises:
        FileNotFoundError: nothing at `path`.
        ValueError: `path` holds no checkpoint qmill reads; the message names those it does.
    """
    given, path = str(path), pathlib.Path(path)
    if not path.exists():
        hint = ""
        if _HUB_ID.fullmatch(given):
            hint = (
                f"; if {given} is a Hugging Face Hub id, download it first (qmill reads local "
                f"folders): hf download {given} --local-dir {path.name}, then quantize "
                f"{path.name}"
            )
        raise FileNotFoundError(f"checkpoint {path} does not exist{hint}")
    if path.is_dir():
        return _open_directory(path)
    files.require_regular_file(path)
    name = path.name
    if name.endswith(".safetensors.index.json"):
        return safetensors_source.open_index(path)
    if name.endswith(".safetensors"):
        return safetensors_source.SafetensorsSource([path])
    if name.endswith(".npz"):
        return npz_source.NpzSource(path)
    # No telling suffix: sniff the first bytes.
    with open(path, "rb") as f:
        magic = f.read(4)
    # torch.save's zip archive, or its older bare pickle (protocol 2+ starts with 0x80).
    if _PICKLES.fullmatch(name) and (magic == _ZIP_MAGIC or magic[:1] == b"\x80"):
        raise ValueError(_pickles_message(path, [name]))
    if magic == _ZIP_MAGIC:
        return npz_source.NpzSource(path)
    if safetensors_header.looks_like_safetensors(path):
        return safetensors_source.SafetensorsSource([path])
    raise ValueError(f"{path} is not a checkpoint qmill reads; expected {_ACCEPTED}")


def format_for_destination(destination: str | os.PathLike, source_format: str) -> str:
    """The format an output is written in when none is asked for: the one its name's suffix
    says (`out.npz`, `out.safetensors`), else the source's. A user who names a file `x.npz`
    expects an npz, not an Orbax directory called x.npz."""
    name = pathlib.Path(destination).name
    if name.endswith(".safetensors"):
        return "safetensors"
    if name.endswith(".npz"):
        return "npz"
    return source_format


# Output names that say "a file of another kind": refused unless --format says what to write.
_SUFFIX = re.compile(r"\.[A-Za-z][A-Za-z0-9_-]*")
_OUTPUT_SUFFIXES = (".safetensors", ".npz")


def check_destination(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    *,
    overwrite: bool,
    output_format: str | None,
) -> None:
    """Refuses outputs that would destroy the source or land somewhere the user did not mean.

    Raises:
        ValueError: the output is the source or inside it; with `overwrite`, the source is
            inside the output (replacing it would delete the source); or, with no
            `output_format`, the output's name ends in a suffix qmill does not write (out.pt).
        FileExistsError: the output exists and `overwrite` is not set.
    """
    src = pathlib.Path(source).resolve()
    dest = pathlib.Path(destination).resolve()
    if dest == src or src in dest.parents:
        raise ValueError(
            f"the output {destination} is the source checkpoint {source} or inside it; "
            "writing there would destroy the source: choose another -o"
        )
    if overwrite and dest in src.parents:
        raise ValueError(
            f"the source {source} is inside the output {destination}; --overwrite would "
            "delete it: choose another -o"
        )
    suffix = pathlib.PurePath(destination).suffix
    if (
        output_format is None
        and _SUFFIX.fullmatch(suffix)
        and suffix not in _OUTPUT_SUFFIXES
        and not pathlib.Path(destination).is_dir()
    ):
        raise ValueError(
            f"the output {destination} ends in {suffix}, which qmill does not write; name it "
            f"{' or '.join('*' + s for s in _OUTPUT_SUFFIXES)}, a name without a suffix (an "
            "Orbax directory, or a folder like the source's), or pass --format "
            f"({', '.join(FORMATS)}) to write that name anyway"
        )
    named = pathlib.Path(destination)
    if not overwrite and (named.exists() or named.is_symlink()):
        raise FileExistsError(f"{named} already exists; pass --overwrite to replace it")


def writes_in_place(format: str) -> bool:
    """Whether `format`'s writer can write its data once, resumably (create_writer's
    `in_place`): safetensors files can, as their header's room is known ahead; npz members are
    compressed into one archive and Orbax commits its own directory."""
    return format in ("safetensors", COMPRESSED_TENSORS)


def _open_directory(path: pathlib.Path) -> protocols.TensorSource:
    pytree = orbax_layout.find_pytree_dir(path)
    if pytree is not None:
        return orbax_source.OrbaxSource(pytree)
    weights = _open_safetensors_directory(path)
    if weights is not None:
        if hf_folder.is_hf_folder(path):
            return hf_folder.HfFolderSource(path, weights)
        # Weights beside other files (a tokenizer, a README, 1_Pooling/) but no config.json:
        # written out as the same folder, so that those files are not silently dropped.
        folder = hf_folder.HfFolderSource(path, weights, has_config=False)
        if any(folder.other_files()):
            return folder
        return weights
    pickles = sorted(p.name for p in path.iterdir() if _PICKLES.fullmatch(p.name))
    if pickles:
        raise ValueError(_pickles_message(path, pickles))
    raise ValueError(
        f"{path} is a directory without a checkpoint qmill reads; expected {_ACCEPTED}"
    )


def _open_safetensors_directory(
    path: pathlib.Path,
) -> safetensors_source.SafetensorsSource | None:
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if len(indexes) == 1:
        return safetensors_source.open_index(indexes[0])
    if len(indexes) > 1:
        names = ", ".join(p.name for p in indexes)
        raise ValueError(f"{path} holds several safetensors indexes ({names}); name one of them")
    files = sorted(path.glob("*.safetensors"))
    return safetensors_source.SafetensorsSource(files) if files else None


def create_writer(
    destination: str | os.PathLike,
    format: str,
    *,
    like: Any = None,
    overwrite: bool = False,
    max_shard_bytes: int | None = None,
    recipe: dict[str, Any] | None = None,
    in_place: staging.InPlace | None = None,
    scheme: ct_schemes.Scheme | None = None,
    global_scales: dict[str, float] | None = None,
) -> protocols.CheckpointWriter:
    """A writer that stages the output beside `destination` and renames it into place on commit.

    Args:
        destination: an Orbax checkpoint directory; an .npz file; for safetensors a file ending
            in .safetensors, or any other path for a directory in the Hugging Face layout
            (model.safetensors, or shards plus model.safetensors.index.json).
        format: "orbax", "safetensors" or "npz".
        like: the source being converted. A sharded safetensors source makes the safetensors
            output sharded the same way; its __metadata__ is carried over.
        overwrite: replace an existing destination (only once the new output is complete).
        max_shard_bytes: safetensors only, when `like` does not shard: start a new shard before
            a tensor that would make the current one larger than this.
        recipe: the recipe the tensors were quantized with; a Hugging Face folder output
            records it in its config.json.
        in_place: for a format that `writes_in_place`: write the data once, there, taking back
            what an interrupted run wrote (staging.InPlace); the writer then has `take_events`.
        scheme, global_scales: compressed-tensors only: the run's plan's scheme and NVFP4
            global scales (checkpoints/run/plan.py); without them, the scheme `recipe` carries.

    Raises:
        ValueError: unknown format, or options the format does not take.
        FileExistsError: `destination` exists and `overwrite` is False.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown checkpoint format {format!r}; qmill writes {', '.join(FORMATS)}")
    if in_place is not None and not writes_in_place(format):
        raise ValueError(f"{format} output is not written in place")
    if format == COMPRESSED_TENSORS:
        if max_shard_bytes is not None:
            raise ValueError("compressed-tensors output shards as its source: no max_shard_bytes")
        if scheme is None:  # a writer made without a plan: the recipe says
            scheme = ct_schemes.scheme_of_recipe(recipe or {})
            global_scales = ct_global.global_scales(recipe or {})
        return ct_writer.create(
            destination,
            like,
            recipe,
            scheme=scheme,
            global_scales=global_scales or {},
            overwrite=overwrite,
            in_place=in_place,
        )
    if max_shard_bytes is not None and (format != "safetensors" or max_shard_bytes <= 0):
        raise ValueError("max_shard_bytes is a positive byte count for safetensors output only")
    if isinstance(like, hf_folder.HfFolderSource):
        if (
            format == "safetensors"
            and not str(destination).endswith(".safetensors")
            and max_shard_bytes is None
        ):
            # A folder in, the same folder out: config, tokenizer and other files included.
            return hf_folder.HfFolderWriter(
                destination, like, recipe, overwrite=overwrite, in_place=in_place
            )
        like = like.weights
    if format == "safetensors":
        return safetensors_writer.SafetensorsWriter(
            destination,
            like=like,
            overwrite=overwrite,
            max_shard_bytes=max_shard_bytes,
            in_place=in_place,
        )
    if format == "npz":
        return npz_writer.NpzWriter(destination, overwrite=overwrite)
    return orbax_writer.OrbaxWriter(destination, overwrite=overwrite)
