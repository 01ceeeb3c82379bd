"""The flags of the client's `qmill` commands: one parser per command, built only for the command
being run (the `qmill` dispatcher, qmill.cli, names the others by their one-line help).

Each command's module is imported here on use: building quantize's flags loads no gRPC client
(qmill.client.client and the services' modules); commands.py runs what these parse.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from qmill.checkpoints.formats.compressed_tensors import schemes as ct_schemes
from qmill.cli import calibrated_lm, report
from qmill.client import credentials, recipes, retry


def _add_jobs(sub: Any, name: str) -> None:
    from qmill.cli import jobs  # lazy, as every other command's module: see add_command

    recipe_help = f"preset ({', '.join(recipes.PRESETS)}) or a TOML recipe file"
    jobs.add_commands(_Only(sub, name), recipe_help=recipe_help)


def _add_module_command(module: str) -> Callable[[Any, str], None]:
    def add(sub: Any, name: str) -> None:
        from qmill.cli import admin, calibrate, export_odml, programs, uploads

        modules = {
            "admin": admin,
            "calibrate": calibrate,
            "export_odml": export_odml,
            "programs": programs,
            "uploads": uploads,
        }
        modules[module].add_command(sub)

    return add


def _add_inspect(sub: Any, name: str) -> None:
    i = sub.add_parser(name, help="list a checkpoint's tensors")
    i.add_argument("checkpoint")


def _add_capabilities(sub: Any, name: str) -> None:
    c = sub.add_parser(name, help="what a server supports")
    c.add_argument("--server", required=True, help="HOST:PORT")
    credentials.add_arguments(c)


class _Only:
    """The `qmill` subparsers, adding only the parser named `name` (a module that adds two
    commands, as jobs.py does, adds the other to a parser that is thrown away)."""

    def __init__(self, sub: Any, name: str) -> None:
        self._sub, self._name = sub, name

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        if name == self._name:
            return self._sub.add_parser(name, **kwargs)
        return argparse.ArgumentParser(prog=name, add_help=False)


def add_command(sub: Any, name: str) -> None:
    """Adds the client command `name`, with all its flags, to the `qmill` parser.

    Each command's module is imported here, for the command being run only: the gRPC client
    (qmill.client.client and the services' modules) is not loaded by `qmill quantize` without
    --server or `qmill inspect`.
    """
    adders: dict[str, Callable[[Any, str], None]] = {
        "quantize": _add_quantize,
        "inspect": _add_inspect,
        "capabilities": _add_capabilities,
        "submit": _add_jobs,
        "jobs": _add_jobs,
        "upload": _add_module_command("uploads"),
        "admin": _add_module_command("admin"),
        "calibrate": _add_module_command("calibrate"),
        "export-odml": _add_module_command("export_odml"),
        "export-program": _add_module_command("programs"),  # a model as a program (no server)
    }
    adders[name](_Only(sub, name), name)


CLIENT_COMMANDS = (
    "quantize", "inspect", "capabilities", "submit", "jobs", "upload", "admin", "calibrate",
    "export-odml", "export-program",
)  # fmt: skip


def add_commands(sub: Any) -> None:
    """Adds every client command to the `qmill` parser."""
    for name in CLIENT_COMMANDS:
        add_command(sub, name)


def _add_quantize(sub: Any, name: str) -> None:
    q = sub.add_parser(name, help="quantize a checkpoint (Orbax, safetensors, npz)")
    q.add_argument("source", help="checkpoint: Orbax directory, .safetensors file/set, or .npz")
    q.add_argument("-o", "--output", required=True, help="where to write the quantized checkpoint")
    q.add_argument(
        "--recipe",
        default="int8",
        help=f"preset ({', '.join(recipes.PRESETS)}), compressed-tensors scheme "
        f"({', '.join(ct_schemes.SCHEMES)}; any case; implies --format compressed-tensors) or a "
        "TOML recipe file (default: int8)",
    )
    q.add_argument(
        "--server",
        help="HOST:PORT of a qmill server; without it the engine runs in-process. Several "
        "(a:1,b:2,...) or dns:///NAME:PORT (every address NAME resolves to) spread the "
        "tensors over all of them",
    )
    q.add_argument(
        "--streams",
        type=int,
        default=1,
        help="concurrent QuantizeParams streams to each --server (default 1); the output is the "
        "same byte for byte",
    )
    q.add_argument(
        "--format",
        choices=("orbax", "safetensors", "npz", ct_schemes.FORMAT),
        help="output format (default: the output's suffix, .npz or .safetensors; else the "
        "input's). safetensors to a name without .safetensors writes a folder: "
        "NAME/model.safetensors, or shards and their index; compressed-tensors: the layout "
        "vLLM and transformers load (with a scheme --recipe)",
    )
    q.add_argument("--overwrite", action="store_true", help="replace an existing output")
    q.add_argument(
        "--restart",
        action="store_true",
        help="discard the partial output of an interrupted run instead of resuming it",
    )
    q.add_argument(
        "--retries",
        type=int,
        default=retry.Backoff().retries,
        help="times to retry, with exponential backoff, while the server is unavailable "
        "(default %(default)s; each retry resumes where the last attempt stopped)",
    )
    q.add_argument(
        "--report-json",
        help="also write the report as JSON to this file: totals, recipe, timings, groups, the "
        "lowest-SQNR tensors and every tensor's row",
    )
    q.add_argument(
        "--table",
        choices=report.TABLES,
        default="summary",
        help="summary (default): the lowest-SQNR tensors, the tensors grouped by qtype and "
        "tiling or by why they were kept, the totals; full: every tensor",
    )
    q.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (each tensor's qtype and tiling, or why it is kept, and its bytes "
        "before and after) without quantizing or writing anything",
    )
    q.add_argument(
        "--calibration",
        metavar="ID|STATS.npz",
        help="apply a calibrated method (GPTQ, AWQ or SmoothQuant, from `qmill calibrate "
        "--method ...`) to the weights it has statistics for: with --server the calibration "
        "id, in-process the statistics file `qmill calibrate --stats-output` wrote",
    )
    q.add_argument(
        "--group-size",
        type=int,
        help="input features per scale in the recipe's grouped rules (W4A16's default 128; a "
        "576-wide layer takes 64 or 32)",
    )
    q.add_argument("--timeout", type=float, help="seconds before the call is abandoned")
    q.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no table")
    calibrated_lm.add_arguments(q)
    credentials.add_arguments(q)
