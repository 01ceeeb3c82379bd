"""`qmill calibrate`: model rules (a preset or TOML), batches from a .npy file, params from a
checkpoint (uploaded, once), on a server (the client's Calibrate, client/calibrate.py) or in this
process (a program); the statistics and the PTQ params written as files.
"""

from __future__ import annotations

import argparse
import os
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from qmill.checkpoints.programs import model_fn
from qmill.cli import model_rules, programs, uploads
from qmill.client import credentials
from qmill.client import programs as client_programs
from qmill.client.calibrate import CalibrateResult, load_batches, write_ptq
from qmill.client.service_client import ServiceClient
from qmill.proto.v1 import qmill_pb2 as pb


def add_command(sub: Any) -> None:
    """Adds `qmill calibrate` to the CLI's subparsers."""
    c = sub.add_parser(
        "calibrate",
        help="activation statistics, or a calibrated method's (GPTQ...), on a server or here",
    )
    c.add_argument(
        "--server",
        help="HOST:PORT; without it a program (--model-fn / --artifact) runs in this process "
        "and the statistics go to --stats-output",
    )
    programs.add_method_argument(c)
    programs.add_model_arguments(c, "model name in the server's registry")
    c.add_argument("--config", default="", help="the model's config as a JSON object")
    programs.add_params_arguments(c)
    c.add_argument(
        "--batches",
        required=True,
        help=".npy file of inputs, examples on axis 0 (a program: one file per model input, "
        "comma-separated)",
    )
    c.add_argument("--batch-size", type=int, default=32, help="examples per batch (default 32)")
    c.add_argument("--calibration-id", default="", help="continue this calibration")
    c.add_argument(
        "--rules",
        default="w8a8-static",
        help=f"preset ({', '.join(model_rules.PRESETS)}) or a TOML file of [[rules]] "
        "(default w8a8-static)",
    )
    c.add_argument("--ptq-output", help="also write the static-range PTQ params here")
    c.add_argument("--stats-output", help="write the merged statistics to this .npz")
    c.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    c.add_argument("--timeout", type=float, help="seconds before a call is abandoned")
    credentials.add_arguments(c)


def run_local(args: argparse.Namespace, print_line: Callable[[str], None]) -> int:
    """`qmill calibrate` without --server: the program runs in this process, batch after batch,
    exactly as a server runs it; the statistics go to --stats-output (`qmill quantize
    --calibration STATS.npz` applies a method's)."""
    if args.model or args.params_upload_id or args.calibration_id or args.ptq_output:
        raise ValueError(
            "--model, --params-upload-id, --calibration-id and --ptq-output need a --server; "
            "in-process, give --model-fn or --artifact and --stats-output"
        )
    if not args.stats_output:
        raise ValueError("in-process (no --server), --stats-output says where the statistics go")
    rules = programs.rule_dicts(model_rules.load_rules(args.rules))
    if args.artifact:
        if not args.params:
            raise ValueError("--artifact needs the model's params: --params")
        data = pathlib.Path(args.artifact).read_bytes()
        batch_size = int(model_fn.read_header(data)["inputs"][0][0][0])
        floats = programs.read_params(args.params)
    else:
        fn = model_fn.load(args.model_fn)
        local = programs.read_params(args.params) if args.params else None
        data, floats = model_fn.calibration_program(
            fn, rules, args.batch_size, local, method=args.method
        )
        batch_size = args.batch_size
    batches = programs.load_batches(args.batches, batch_size, print_line)
    stats, count, examples = model_fn.run_calibration(data, floats, batches)
    print_line(f"calibration in-process: {count} batches, {examples} examples; {len(stats)} stats")
    _write_stats(stats, args, print_line)
    return 0


def run_command(
    client: ServiceClient, args: argparse.Namespace, print_line: Callable[[str], None]
) -> int:
    """Runs `qmill calibrate` on `client`; returns the exit code."""
    rules = model_rules.load_rules(args.rules)
    if not args.model:
        return _run_program(client, args, rules, print_line)
    if not (args.params or args.params_upload_id):
        raise ValueError("--model needs the model's params: --params or --params-upload-id")
    batches = load_batches(args.batches, args.batch_size)
    start = pb.CalibrateStart(
        model=pb.ModelSpec(name=args.model, config_json=args.config),
        params_upload_id=uploads.params_upload_id(client, args, print_line),
        rules=rules,
        calibration_id=args.calibration_id,
        return_ptq_params=bool(args.ptq_output),
    )
    result = client.calibrate(start, batches)
    _report(result, args, print_line)
    if args.ptq_output:
        n = write_ptq(result, args.ptq_output, overwrite=args.overwrite)
        quantized = sum(1 for p in result.params.values() if "qvalue" in p)
        print_line(f"PTQ params: {n} tensors ({quantized} quantized) → {args.ptq_output}")
    return 0


def _run_program(
    client: ServiceClient,
    args: argparse.Namespace,
    rules: list[pb.ModelRule],
    print_line: Callable[[str], None],
) -> int:
    """`qmill calibrate --artifact | --model-fn`: the program runs on the server; --ptq-output
    then asks QuantizeParams for the static-range params of the uploaded params."""
    program, upload_id, batch_size, floats = programs.calibration_program(
        client, args, rules, print_line
    )
    start = pb.CalibrateStart(
        params_upload_id=upload_id,
        calibration_id=args.calibration_id,
        **client_programs.program_fields(client, program),
    )
    batches = programs.load_batches(args.batches, batch_size, print_line)
    result = client.calibrate(start, batches)
    _report(result, args, print_line)
    if args.ptq_output:
        cid = result.summary.calibration_id
        n = programs.write_srq(client, upload_id, cid, rules, floats, args)
        print_line(f"PTQ params: {n} tensors (static ranges of {cid}) → {args.ptq_output}")
    return 0


def _report(result: CalibrateResult, args: argparse.Namespace, print_line) -> None:
    s = result.summary
    print_line(
        f"calibration {s.calibration_id}: {s.batches_total} batches, {s.examples_total} "
        f"examples in total; {len(result.stats)} statistics"
    )
    if args.stats_output:
        _write_stats(result.stats, args, print_line)


def _write_stats(stats: dict[str, np.ndarray], args: argparse.Namespace, print_line) -> None:
    tmp = pathlib.Path(args.stats_output + ".partial.npz")
    np.savez(tmp, **stats)
    if os.path.exists(args.stats_output) and not args.overwrite:
        tmp.unlink()
        raise FileExistsError(f"{args.stats_output} exists; pass --overwrite to replace it")
    os.replace(tmp, args.stats_output)
    print_line(f"statistics → {args.stats_output}")
