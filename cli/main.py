"""`qmill`: a thin dispatcher over the client's commands and the server's `serve`.

This is the composition root (docs/architecture.md): client and server never import each other, and
what the server needs from the client side -- the fan-out client its batch jobs use to spread
tensors over --job-peers -- is handed to it here (serve.py).

Only the command being run is imported: `qmill --help` and `--version` list the commands from
COMMANDS below and load no client or server code (no jax, grpc or orbax: 0.1 s, not 1 s), and
`qmill quantize` builds only quantize's flags. The other commands are named in the parser by
their one-line help, so `qmill --help` and a mistyped command still list them all.

User errors print one line and exit 1; tracebacks are kept for bugs.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import sys
from collections.abc import Sequence
from importlib import metadata

# Every command and its one-line help (a test checks that each equals the help its module gives).
COMMANDS = {
    "quantize": "quantize a checkpoint (Orbax, safetensors, npz)",
    "inspect": "list a checkpoint's tensors",
    "serve": "run the qmill gRPC server",
    "capabilities": "what a server supports",
    "submit": "run a quantize job on a server (server-side paths)",
    "jobs": "list, watch or cancel jobs on a server",
    "upload": "store a checkpoint on a server once (prints its upload id)",
    "calibrate": "activation statistics, or a calibrated method's (GPTQ...), on a server or here",
    "export-odml": "export a LiteRT (.tflite) model from a server",
    "export-program": "write a model as a program for a qmill server",
    "admin": "server-wide operations (admin token)",
}


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `qmill` parser with every flag of `command` (all commands' when None; only the
    one-line help of each when `command` is "")."""
    parser = argparse.ArgumentParser(
        prog="qmill", description="Quantization as a service for JAX checkpoints."
    )
    parser.add_argument("--version", action="version", version=f"qmill {metadata.version('qmill')}")
    # metavar: the usage line says COMMAND, not all eleven names (110 columns).
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        if command is not None and name != command:
            # Listed in --help; its flags are parsed only when it is the command run.
            sub.add_parser(name, help=help_text, add_help=False)
        elif name == "serve":
            from qmill.server import command as serve_command  # lazy: only `qmill serve`

            serve_command.add_arguments(sub.add_parser(name, help=help_text))
        else:
            from qmill.cli import parsers  # lazy: grpc and the command's own module

            parsers.add_command(sub, name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # At exit the interpreter's last garbage collections walk every object jax, orbax and the
    # engine made: ~0.3 s of a 2 s quick start. Frozen (gc.freeze), they are skipped; nothing of
    # ours waits on them (outputs are closed and committed before a command returns). Once per
    # process, however often main runs in it.
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    own_process = argv is None  # the `qmill` command itself, not a caller's main(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in COMMANDS else ""
    args = _parser(command).parse_args(argv)
    if args.command == "quantize" and getattr(args, "method", None) and not args.server:
        from qmill.cli import process_env

        process_env.prepare_calibrated_run(argv, own_process)
    from qmill.cli import commands  # lazy: only once a command is run

    try:
        if args.command == "serve":
            from qmill.cli import serve

            return serve.run(args)
        return commands.run(args)
    except commands.USER_ERRORS as e:
        print(f"qmill: error: {commands.user_message(e, args)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "qmill: interrupted; no output was written under the final name (quantize: "
            "re-run the same command to resume)",
            file=sys.stderr,
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
