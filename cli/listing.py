"""`qmill inspect`: a checkpoint's tensors (dtype, shape, bytes as stored), what a Hugging Face
folder holds besides them, and how many are quantized."""

from __future__ import annotations

import argparse

from rich import box
from rich.console import Console

from qmill import checkpoints
from qmill.checkpoints.base import dtypes as checkpoint_dtypes
from qmill.checkpoints.formats import config_summary
from qmill.checkpoints.formats.hf_folder import folder as hf_folder
from qmill.cli import report_table


def run(args: argparse.Namespace, out: Console) -> int:
    with checkpoints.open_source(args.checkpoint) as source:
        entries = source.entries()
        rows = [
            # As stored: 4-bit codes take half a byte each on disk (and on the wire).
            (
                e.path,
                e.dtype.name,
                "×".join(map(str, e.shape)) or "scalar",
                f"{checkpoint_dtypes.packed_nbytes(e.dtype, e.shape):,}",
            )
            for e in entries
        ]
        columns = [
            report_table.Column("dtype"),
            report_table.Column("shape"),
            report_table.Column("bytes", "right"),
        ]
        title = f"{args.checkpoint} ({source.format})"
        table = report_table.PathTable(
            title, columns, rows, whole=True, box=box.SQUARE, pad_edge=True
        )
        folder = _folder_lines(source) if isinstance(source, hf_folder.HfFolderSource) else []
    out.print(table)
    for text in folder:
        out.print(text, markup=False, highlight=False, soft_wrap=True)
    # A quantized leaf P is stored as P/array/qvalue (+ scale, zero_point).
    leaves = [e for e in entries if e.path.endswith(("/array/qvalue", ".array.qvalue"))]
    dtypes = sorted({e.dtype.name for e in leaves})
    quantized = f"; {len(leaves)} quantized leaves ({', '.join(dtypes)})" if leaves else ""
    # compressed-tensors stores a quantized weight M.weight as M.weight_scale and its codes.
    compressed = sum(e.path.endswith(".weight_scale") for e in entries)
    quantized += f"; {compressed} compressed-tensors weights" if compressed else ""
    stored = sum(checkpoint_dtypes.packed_nbytes(e.dtype, e.shape) for e in entries)
    out.print(
        f"{len(entries)} tensors, {stored:,} bytes{quantized}",
        markup=False,
        highlight=False,
    )
    return 0


def _folder_lines(source: hf_folder.HfFolderSource) -> list[str]:
    """What a Hugging Face model folder holds besides its tensors."""
    config = source.config
    architectures = ", ".join(config.get("architectures") or []) or "-"
    title = (
        f"Hugging Face model folder {source.folder}: model_type "
        f"{config.get('model_type', '-')}, architectures {architectures}"
        if source.has_config
        else f"folder {source.folder}: no config.json (no model transformers or vLLM can load)"
    )
    lines = [
        title,
        "weights: "
        + ", ".join(f"{p.name} ({p.stat().st_size:,} bytes)" for p in source.weight_files()),
    ]
    copied, left_out = source.other_files()
    names = ", ".join(str(p) for p in copied)
    lines.append(f"other files ({len(copied)}, copied as they are when quantized): {names}")
    if left_out:
        lines.append(
            "weights in other formats (left out when quantized): "
            + ", ".join(str(p) for p in left_out)
        )
    if source.has_config:  # else the tensors' names say it (the last line of inspect)
        lines.append(config_summary.describe(config))
    return lines
