"""`qmill`: a thin dispatcher over the client's commands and the server's `serve`.

This is the composition root (docs/architecture.md): client and server never import each other, and
what the server needs from the client side -- the fan-out client its batch jobs use to spread
tensors over --job-peers -- is handed to it here (serve.py).

User errors print one line and exit 1; tracebacks are kept for bugs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import metadata

from rich.console import Console

from qmill.client import commands


def _parser(with_serve_flags: bool = True) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qmill", description="Quantization as a service for JAX checkpoints."
    )
    parser.add_argument("--version", action="version", version=f"qmill {metadata.version('qmill')}")
    sub = parser.add_subparsers(dest="command", required=True)
    commands.add_commands(sub)
    serve_help = "run the qmill gRPC server"
    if with_serve_flags:
        from qmill.server import command as serve_command  # lazy: only `qmill serve` needs it

        serve_command.add_arguments(sub.add_parser("serve", help=serve_help))
    else:
        # The server's flags are parsed only when `serve` is the command (qmill serve --help).
        sub.add_parser("serve", help=serve_help, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser(with_serve_flags=argv[:1] == ["serve"]).parse_args(argv)
    out, err = Console(), Console(stderr=True)
    try:
        if args.command == "serve":
            from qmill.cli import serve

            return serve.run(args)
        return commands.run(args, out, err)
    except commands.USER_ERRORS as e:
        print(f"qmill: error: {e}", file=sys.stderr)
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
