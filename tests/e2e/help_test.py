"""`qmill --help` as a newcomer meets it: it loads nothing heavy, lists every command with its
own help, and every help screen fits 80 columns. (How fast it starts is measured in
bench/startup_bench.py, not asserted here.)"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata

import pytest

from qmill.cli import main

# What `--help` and `--version` must not import: each costs a large part of a second.
HEAVY = ("jax", "grpc", "orbax", "qmill.client.client", "qmill.server")


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_import_no_jax_grpc_or_orbax(flag):
    code = (
        "import sys\n"
        "from qmill.cli import main\n"
        f"try:\n    main.main([{flag!r}])\nexcept SystemExit:\n    pass\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    *shown, imported = result.stdout.splitlines()
    assert imported == "", f"{flag} imported {imported}"
    if flag == "--help":
        assert "quantize" in "\n".join(shown)
    else:
        assert shown == [f"qmill {metadata.version('qmill')}"]


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def test_the_command_list_is_each_commands_own_help():
    # `qmill --help` lists COMMANDS without importing the commands; the help each command's
    # module gives must be the same line (else `qmill --help` and `qmill X --help` disagree).
    full = _subparsers(main._parser(None))
    own = {action.dest: action.help for action in full._choices_actions}
    assert own == main.COMMANDS


def _help_screens(name: str) -> list[tuple[str, str]]:
    parser = main._parser(name)
    screens = [("qmill", parser.format_help())]
    command = _subparsers(parser).choices[name]
    screens.append((command.prog, command.format_help()))
    for action in command._actions:
        if isinstance(action, argparse._SubParsersAction):  # qmill jobs list|watch|cancel
            screens += [(p.prog, p.format_help()) for p in action.choices.values()]
    return screens


@pytest.mark.parametrize("name", list(main.COMMANDS))
def test_every_help_screen_fits_80_columns(name, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps to the terminal's width
    for prog, text in _help_screens(name):
        wide = [line for line in text.splitlines() if len(line) > 80]
        assert not wide, f"{prog} --help:\n" + "\n".join(wide)
    usage = main._parser("").format_usage()
    assert usage.strip() == "usage: qmill [-h] [--version] COMMAND ..."


def test_serve_help_says_where_the_server_keeps_its_data(monkeypatch):
    monkeypatch.setenv("QMILL_DATA_DIR", "/srv/qmill/data")
    text = " ".join(_subparsers(main._parser("serve")).choices["serve"].format_help().split())
    assert "kept in the data dir: /srv/qmill/data" in text
    assert "jobs.sqlite3" in text and "~/.cache/qmill" in text


def test_a_mistyped_command_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main.main(["quantise", "x"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'quantise'" in err and "'quantize'" in err
