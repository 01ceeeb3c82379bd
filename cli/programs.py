"""Models that travel as programs, on the command line: `--artifact FILE` or `--model-fn M:F`.

`qmill export-program` writes an artifact; `qmill calibrate` and `qmill export-odml` take one (or
build it from the entry point) instead of a registry model name. The model's code runs only
here; see docs/remote-models.md for the flow as a user runs it.
"""

from __future__ import annotations

import argparse
import os
import pathlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import safetensors.numpy

from qmill import checkpoints
from qmill.checkpoints.programs import model_fn
from qmill.cli import model_rules, uploads
from qmill.client.service_client import ServiceClient
from qmill.proto.v1 import qmill_pb2 as pb


def add_model_arguments(parser: argparse.ArgumentParser, registry_help: str) -> None:
    """--model NAME | --artifact FILE | --model-fn MODULE:FUNCTION, exactly one."""
    group = parser.add_mutually_exclusive_group(required=True)
    # Short metavars: the group is one unit of the usage line, which must fit 80 columns.
    group.add_argument("--model", metavar="NAME", help=registry_help)
    group.add_argument(
        "--artifact", metavar="FILE", help="a program written by `qmill export-program`"
    )
    group.add_argument(
        "--model-fn",
        metavar="MOD:FUNC",
        help="module:function, a Python function returning {'model', 'inputs'[, 'params']}: "
        "the model is made into a program here, its code never leaves this machine",
    )


def add_params_arguments(parser: argparse.ArgumentParser) -> None:
    """--params CKPT | --params-upload-id ID; optional with --model-fn (an NNX model holds its
    params)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--params",
        metavar="CKPT",
        help="the model's float params: a checkpoint (safetensors, npz or Orbax directory), "
        "uploaded first; content the server already holds is not sent again",
    )
    group.add_argument(
        "--params-upload-id",
        metavar="ID",
        help="the model's float params as an earlier upload (`qmill upload` prints its id)",
    )


METHODS = ("static", "gptq", "awq", "smoothquant")


def add_method_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--method",
        choices=METHODS,
        default="static",
        help="what the calibration collects: static activation ranges (default), or a "
        "calibrated weight method's statistics, which `qmill quantize --calibration` applies",
    )


def rule_dicts(rules: Sequence[pb.ModelRule]) -> list[dict[str, Any]]:
    """ModelRule messages as the dicts qmill.checkpoints.model_fn takes."""
    fields = [f.name for f in pb.ModelRule.DESCRIPTOR.fields]
    return [{name: getattr(r, name) for name in fields} for r in rules]


def read_params(path: str) -> dict[str, np.ndarray]:
    """A checkpoint's float params by '/'-joined path (a leading "params/" level dropped)."""
    with checkpoints.open_source(path) as source:
        flat = {e.path: source.read(e.path) for e in source.entries()}
    if flat and all(p.startswith("params/") for p in flat):
        flat = {p.removeprefix("params/"): v for p, v in flat.items()}
    return flat


def load_batches(spec: str, batch_size: int, print_line: Callable[[str], None]) -> Iterator[Any]:
    """Batches from one .npy per model input (comma-separated): tuples of arrays of exactly
    `batch_size` examples, as a program takes them; a smaller last batch is left out (said)."""
    arrays = [np.load(p, mmap_mode="r", allow_pickle=False) for p in spec.split(",")]
    n = len(arrays[0])
    if any(a.ndim == 0 or len(a) != n for a in arrays):
        raise ValueError(f"--batches {spec}: every file needs the same number of examples")
    if n % batch_size:
        print_line(
            f"leaving out the last {n % batch_size} example(s): a program takes batches of "
            f"exactly {batch_size}"
        )
    for start in range(0, n - batch_size + 1, batch_size):
        batch = tuple(np.ascontiguousarray(a[start : start + batch_size]) for a in arrays)
        yield batch if len(batch) > 1 else batch[0]


def calibration_program(
    client: ServiceClient,
    args: argparse.Namespace,
    rules: Sequence[pb.ModelRule],
    print_line: Callable[[str], None],
) -> tuple[bytes, str, int, dict[str, np.ndarray] | None]:
    """(program, params upload id, batch size, float params when built here)."""
    local_params = read_params(args.params) if args.params and args.model_fn else None
    if args.artifact:
        data = pathlib.Path(args.artifact).read_bytes()
        header = model_fn.read_header(data)
        if header.get("kind") != "calibrate":
            raise ValueError(
                f"--artifact {args.artifact} is not a calibrate program (kind "
                f"{header.get('kind')!r}): make one with `qmill export-program --kind calibrate`"
            )
        batch_size, floats = int(header["inputs"][0][0][0]), None
    else:
        fn = model_fn.load(args.model_fn)
        data, floats = model_fn.calibration_program(
            fn, rule_dicts(rules), args.batch_size, local_params, method=args.method
        )
        batch_size = args.batch_size
        print_line(f"program {args.model_fn}: {len(data):,} bytes, batches of {batch_size}")
    if args.params or args.params_upload_id:
        upload_id = uploads.params_upload_id(client, args, print_line)
    elif floats is not None:
        status = client.upload(safetensors.numpy.save(floats), name=args.model_fn)
        print_line(f"params of {args.model_fn}: upload {status.upload_id}")
        upload_id = status.upload_id
    else:
        raise ValueError("--artifact needs the model's params: --params or --params-upload-id")
    return data, upload_id, batch_size, floats or local_params


def write_srq(
    client: ServiceClient,
    upload_id: str,
    calibration_id: str,
    rules: Sequence[pb.ModelRule],
    floats: Mapping[str, np.ndarray] | None,
    args: argparse.Namespace,
) -> int:
    """Static-range PTQ params by QuantizeParams on the upload with the calibration's ranges,
    written as a checkpoint in the PTQ layout; returns the tensor count."""
    qtypes = {r.weight_qtype for r in rules}
    if len(qtypes) != 1 or not next(iter(qtypes)):
        raise ValueError("--ptq-output with a program needs one weight_qtype for every rule")
    if floats is None:
        floats = read_params(args.params) if args.params else None
    ranges = pb.StaticRanges(calibration_id=calibration_id)
    fmt = checkpoints.format_for_destination(args.ptq_output, "orbax")
    n = 0
    with checkpoints.create_writer(args.ptq_output, fmt, overwrite=args.overwrite) as writer:
        for o in client.quantize_upload(next(iter(qtypes)), upload_id, static_ranges=ranges):
            # A checkpoint of Flax variables nests the params under "params/" (read_params and
            # the server's programs drop it): the PTQ tree is the params collection itself.
            path = o.path.removeprefix("params/")
            if o.quantized:
                writer.write_quantized(path, o.parts)
            elif o.parts:
                writer.write(path, o.parts["value"])
            elif floats is not None:
                writer.write(path, floats[path])
            else:
                raise ValueError("--ptq-output needs --params (kept tensors come from it)")
            n += 1
        writer.commit()
    return n


def export_program(args: argparse.Namespace, rules: Sequence[pb.ModelRule]) -> bytes:
    """An export program: read from --artifact or built from --model-fn."""
    if args.artifact:
        data = pathlib.Path(args.artifact).read_bytes()
        kind = model_fn.read_header(data).get("kind")
        if kind != "export":
            raise ValueError(
                f"--artifact {args.artifact} is not an export program (kind {kind!r}): make one "
                "with `qmill export-program --kind export`"
            )
        return data
    fn = model_fn.load(args.model_fn)
    params = read_params(args.params) if args.params else None
    stats = None
    if args.stats:
        with np.load(args.stats, allow_pickle=False) as f:
            stats = {k: f[k] for k in f.files}
    elif any(r.act_static_scale for r in rules):
        raise ValueError("static-range rules need --stats (from `qmill calibrate --stats-output`)")
    return model_fn.export_program(fn, rule_dicts(rules), params, stats)


# ---------------------------------------------------------------------------------------- CLI


def add_command(sub: Any) -> None:
    """Adds `qmill export-program` (no server needed)."""
    e = sub.add_parser("export-program", help="write a model as a program for a qmill server")
    e.add_argument("--model-fn", required=True, metavar="MODULE:FUNCTION", help="the model")
    e.add_argument("--kind", choices=("calibrate", "export"), default="calibrate")
    e.add_argument(
        "--rules", default="w8a8-static", help=f"preset ({', '.join(model_rules.PRESETS)}) or TOML"
    )
    e.add_argument("--batch-size", type=int, default=32, help="calibrate: examples per batch")
    add_method_argument(e)
    e.add_argument("--params", metavar="CKPT", help="the float params (else the model's own)")
    e.add_argument("--stats", help="export: statistics .npz from `qmill calibrate --stats-output`")
    e.add_argument("--params-output", help="calibrate: also write the float params (safetensors)")
    e.add_argument("-o", "--output", required=True, help="the artifact file to write")
    e.add_argument("--overwrite", action="store_true", help="replace existing outputs")


def run_local(args: argparse.Namespace, print_line: Callable[[str], None]) -> int:
    """Runs `qmill export-program`; returns the exit code."""
    rules = model_rules.load_rules(args.rules)
    args.artifact = None
    if args.kind == "export":
        data = export_program(args, rules)
    else:
        fn = model_fn.load(args.model_fn)
        params = read_params(args.params) if args.params else None
        data, floats = model_fn.calibration_program(
            fn, rule_dicts(rules), args.batch_size, params, method=args.method
        )
        if args.params_output:
            _write(args.params_output, safetensors.numpy.save(floats), args.overwrite)
            print_line(f"float params: {len(floats)} tensors → {args.params_output}")
    _write(args.output, data, args.overwrite)
    print_line(f"{args.kind} program: {len(data):,} bytes → {args.output}")
    return 0


def _write(path: str, data: bytes, overwrite: bool) -> None:
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} exists; pass --overwrite to replace it")
    tmp = pathlib.Path(path + ".partial")
    tmp.write_bytes(data)
    os.replace(tmp, path)
