"""A FIFO anywhere inside an Orbax directory is refused before Orbax opens it (issue 18, item 3):
Orbax reads its data files itself, and reading a FIFO blocks until a writer appears."""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from qmill import checkpoints
from tests.e2e import processes


@pytest.mark.parametrize("victim", ["data file", "_METADATA"])
def test_a_fifo_inside_an_orbax_directory_is_refused(tmp_path, victim):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(processes.SOURCE, ckpt)
    target = next((ckpt / "d").iterdir()) if victim == "data file" else ckpt / "_METADATA"
    target.unlink()
    os.mkfifo(target)
    outcome: list[BaseException | None] = []

    def read_all() -> None:
        try:
            with checkpoints.open_source(ckpt) as source:
                for entry in source.entries():
                    source.read(entry.path)
            outcome.append(None)
        except BaseException as e:  # handed to the test thread
            outcome.append(e)

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    reader.join(60)
    if reader.is_alive():  # blocked on the FIFO: open it for writing to let the reader go
        with open(target, "wb"):
            pass
        reader.join(10)
        pytest.fail(f"reading the checkpoint blocked on the FIFO {target}")
    (error,) = outcome
    assert isinstance(error, ValueError), error
    if victim == "data file":
        assert str(error) == f"{target} is a FIFO; qmill reads checkpoints from regular files only"
    else:  # without a regular _METADATA the directory is no Orbax checkpoint at all
        assert str(error).startswith(f"{ckpt} is a directory without a checkpoint"), error
