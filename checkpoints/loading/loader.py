"""Reading a quantized checkpoint back as the param tree a PtqProvider model takes.

Any output qmill writes -- Orbax, safetensors (one file or a sharded set) or npz -- holds a
quantized leaf P as P/array/qvalue, P/array/scale (and P/array/zero_point), an AWQ / SmoothQuant
one also P/awq_scale / P/inv_sq_scale (the reference's WithAwqScale / WithSqScale), a static
activation scale as P/array, float leaves as themselves. `load` splits every path at '/' into a
nested dict:

    {"Dense_0": {"kernel": {"array": {"qvalue": int4[16, 64], "scale": float32[1, 64]}}}}

with the true dtypes (int4, uint4, float4_e2m1fn ...; 4-bit codes come back unpacked). That is
the pure dict of an NNX PTQ model: `nnx.update(abs_ptq_model, load(path, as_jax=True))`. A Linen
PTQ model keeps each quantized weight as a `WithAux` holding a `QArray`, dataclasses that also
carry how the weight was quantized; `like=` (the model's abstract params, from
`jax.eval_shape(ptq_model.init, key, x)["params"]`) fills those in, giving the tree
`ptq_model.apply({"params": tree}, x)` takes, exactly what `quantize_params` returns.

jax is imported only when arrays are asked for on a device (`as_jax` / `device`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from qmill.checkpoints.formats import registry as formats
from qmill.checkpoints.formats.compressed_tensors import reader as ct_reader


def load(
    path: str | os.PathLike[str],
    *,
    like: Any = None,
    as_jax: bool = False,
    device: Any = None,
    flax_layout: bool = False,
) -> dict[str, Any]:
    """The nested param tree of checkpoint `path`, every tensor in its logical dtype and shape.

    Args:
      path: an Orbax directory, a .safetensors file, sharded set or folder, or an .npz archive.
      like: the abstract params of a Linen PTQ model; the result then has its WithAux / QArray
        leaves (and is checked against its shapes and dtypes). Leave out for NNX (pure dicts).
      as_jax: jax arrays instead of numpy ones.
      device: a jax device (or sharding) to put the arrays on; implies `as_jax`.
      flax_layout: a compressed-tensors checkpoint (vLLM's format, llm-compressor's output)
        only: each quantized weight's parts transposed from PyTorch's (out, in) to Flax's
        (in, out). Such a checkpoint is read as the same tree either way (ct_reader).

    Raises:
      ValueError: the checkpoint's paths don't form a tree, or it doesn't fit `like`.
    """
    flat: dict[str, np.ndarray] = {}
    with formats.open_source(path) as source:
        for entry in source.entries():
            flat[entry.path] = source.read(entry.path)
        compressed_tensors = ct_reader.config_of(source)
    if compressed_tensors is not None:
        flat = ct_reader.to_qwix(flat, compressed_tensors, flax_layout=flax_layout)
    elif flax_layout:
        raise ValueError(
            f"{path} is not a compressed-tensors checkpoint: flax_layout does not apply"
        )
    if as_jax or device is not None:
        import jax

        flat = {k: jax.device_put(v, device) for k, v in flat.items()}
    tree = nest(flat)
    return tree if like is None else fill(like, tree)


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{'/'-joined path: array} -> nested dicts (a safetensors name keeps its dots)."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        *parents, name = path.split("/")
        node = tree
        for i, key in enumerate(parents):
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ValueError(f"tensor {path} lies under tensor {'/'.join(parents[: i + 1])}")
        if name in node:
            raise ValueError(f"tensor {path} is also the parent of other tensors")
        node[name] = value
    return tree


def fill(like: Any, tree: Any, where: str = "") -> Any:
    """`like` (abstract Linen params) with its array leaves taken from the nested `tree`.

    Dataclass nodes (WithAux, QArray) are rebuilt with `dataclasses.replace`, so the fields that
    are not arrays (how a weight was quantized, its qtype) come from `like`. Keys `tree` has and
    `like` lacks are kept as they are.
    """
    if hasattr(like, "unbox") and hasattr(like, "replace_boxed"):
        # flax.linen.Partitioned and other metadata boxes around a param: fill what they hold
        # and keep the box, as the model's own params have it.
        return like.replace_boxed(fill(like.unbox(), tree, where))
    here = where or "the checkpoint's root"
    if isinstance(like, Mapping):
        if not isinstance(tree, Mapping):
            raise ValueError(f"{here}: the model has a subtree here, the checkpoint a tensor")
        missing = sorted(set(like) - set(tree))
        if missing:
            raise ValueError(f"{here}: the checkpoint lacks {missing}")
        out = dict(tree)
        out.update({k: fill(v, tree[k], f"{where}/{k}".lstrip("/")) for k, v in like.items()})
        return out
    if dataclasses.is_dataclass(like) and not isinstance(like, type):
        return _fill_dataclass(like, tree, where)
    return _check_leaf(like, tree, where)


def _fill_dataclass(like: Any, tree: Any, where: str) -> Any:
    arrays = [f for f in dataclasses.fields(like) if f.metadata.get("pytree_node", True)]
    if not isinstance(tree, Mapping):
        if len(arrays) != 1:
            raise ValueError(
                f"{where}: the model has a quantized array here, the checkpoint one tensor"
            )
        # One array field (a static activation scale's WithAux) stored without its /array key.
        return dataclasses.replace(
            like, **{arrays[0].name: fill(getattr(like, arrays[0].name), tree, where)}
        )
    values = {}
    for field in arrays:
        sub = getattr(like, field.name)
        if field.name in tree:
            values[field.name] = fill(sub, tree[field.name], f"{where}/{field.name}")
        elif sub is not None:
            raise ValueError(f"{where}: the checkpoint lacks {field.name}")
    return dataclasses.replace(like, **values)


def _check_leaf(like: Any, value: Any, where: str) -> Any:
    if isinstance(value, Mapping):
        raise ValueError(f"{where}: the model has a tensor here, the checkpoint {sorted(value)}")
    want = (
        tuple(getattr(like, "shape", value.shape)),
        np.dtype(getattr(like, "dtype", value.dtype)),
    )
    got = (tuple(value.shape), np.dtype(value.dtype))
    if want != got:
        raise ValueError(
            f"{where}: the model wants {want[1].name}{list(want[0])}, the checkpoint has "
            f"{got[1].name}{list(got[0])}"
        )
    return value
