"""The in-process calibrated run turns XLA:GPU's autotuning off (cli/main._no_gpu_autotuning):
only for `quantize --method` without --server, and never over a user's own XLA_FLAGS setting."""

from __future__ import annotations

import pytest

from qmill.cli import main


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """Runs main() up to the command and records XLA_FLAGS as the command would see it."""
    flags: list[str | None] = []
    from qmill.cli import commands

    def record(args) -> int:
        import os

        flags.append(os.environ.get("XLA_FLAGS"))
        return 0

    monkeypatch.setattr(commands, "run", record)
    return flags


@pytest.mark.parametrize(
    ("argv", "before", "after"),
    [
        (["--method", "gptq"], None, "--xla_gpu_autotune_level=0"),
        (["--method", "gptq"], "--xla_dump_to=/d", "--xla_dump_to=/d --xla_gpu_autotune_level=0"),
        (["--method", "gptq"], "--xla_gpu_autotune_level=4", "--xla_gpu_autotune_level=4"),
        (["--method", "gptq", "--server", "h:1"], None, None),
        ([], None, None),
    ],
)
def test_autotuning_is_off_only_for_in_process_calibrated_runs(
    monkeypatch: pytest.MonkeyPatch, seen: list, argv: list[str], before, after
) -> None:
    if before is None:
        monkeypatch.delenv("XLA_FLAGS", raising=False)
    else:
        monkeypatch.setenv("XLA_FLAGS", before)
    assert main.main(["quantize", "src", "-o", "out", *argv]) == 0
    assert seen == [after]
