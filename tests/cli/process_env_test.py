"""An in-process calibrated run's process settings (cli/process_env.py): XLA:GPU autotuning off
and glibc's huge-page tunable on, only for `quantize --method` without --server, never over a
user's own setting; the re-execution happens only when main() is the process's entry point."""

from __future__ import annotations

import os
import sys

import pytest

from qmill.cli import commands, main, process_env


def test_settings_are_added_where_the_user_set_none() -> None:
    env = process_env.calibrated_run_env({"PATH": "/bin"})
    assert env["XLA_FLAGS"] == "--xla_gpu_autotune_level=0"
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert env["PATH"] == "/bin"


def test_the_users_own_settings_win_and_others_are_kept() -> None:
    mine = {"XLA_FLAGS": "--xla_gpu_autotune_level=4", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert process_env.calibrated_run_env(mine) == mine
    other = {"XLA_FLAGS": "--xla_dump_to=/d", "GLIBC_TUNABLES": "glibc.malloc.arena_max=1"}
    env = process_env.calibrated_run_env(other)
    assert env["XLA_FLAGS"] == "--xla_dump_to=/d --xla_gpu_autotune_level=0"
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=1:glibc.malloc.hugetlb=1"


class _Exec(Exception):
    pass


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list:
    """main() up to the command: what it re-executed, or the XLA_FLAGS the command saw."""
    seen: list = []

    def execve(path, args, env):
        seen.append(("exec", path, args, env["GLIBC_TUNABLES"], env["XLA_FLAGS"]))
        raise _Exec

    monkeypatch.setattr(commands, "run", lambda args: seen.append(os.environ.get("XLA_FLAGS")))
    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.setattr(process_env, "_glibc_linux", lambda: True)
    # main() sets XLA_FLAGS in os.environ itself: a copy keeps it from the later tests.
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if k not in ("XLA_FLAGS", "GLIBC_TUNABLES")})  # fmt: skip
    return seen


def test_the_command_itself_restarts_once_with_the_settings(
    monkeypatch: pytest.MonkeyPatch, calls: list
) -> None:
    argv = ["quantize", "src", "-o", "out", "--method", "gptq"]
    monkeypatch.setattr(sys, "argv", ["qmill", *argv])
    with pytest.raises(_Exec):
        main.main()
    assert calls == [
        ("exec", sys.executable, [sys.executable, "-m", "qmill.cli", *argv],
         "glibc.malloc.hugetlb=1", "--xla_gpu_autotune_level=0"),
    ]  # fmt: skip
    # The restarted process has the tunable: it runs the command, no second restart.
    calls.clear()
    os.environ["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    main.main()
    assert calls == ["--xla_gpu_autotune_level=0"]


@pytest.mark.parametrize(
    ("argv", "seen"),
    [
        (["--method", "gptq"], "--xla_gpu_autotune_level=0"),  # a caller's main(argv): no exec
        (["--method", "gptq", "--server", "h:1"], None),
        ([], None),
    ],
)
def test_other_runs_are_left_alone(calls: list, argv: list[str], seen) -> None:
    main.main(["quantize", "src", "-o", "out", *argv])
    assert calls == [seen]
