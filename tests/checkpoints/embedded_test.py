"""EmbeddedClient quantizes one tensor ahead of its caller, in order, errors in their place."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

from qmill.checkpoints.base import errors
from qmill.checkpoints.run import embedded

RECIPE = {"rules": [{"path_regex": ".*", "qtype": "int8"}]}


def _tensors(count: int, asked: list[int], fail_at: int | None = None):
    for i in range(count):
        asked.append(i)
        if i == fail_at:
            raise OSError(f"tensor {i} unreadable")
        yield f"w{i}", np.full((8, 4), i + 1, np.float32)


def test_the_next_tensor_is_read_and_quantized_while_the_caller_holds_an_outcome() -> None:
    asked: list[int] = []
    outcomes = embedded.EmbeddedClient().quantize(RECIPE, _tensors(3, asked))
    first = next(outcomes)
    assert first.path == "w0" and first.quantized
    # The worker goes on with w1 while this caller holds w0's outcome (it would be writing it).
    for _ in range(200):
        if asked == [0, 1]:
            break
        threading.Event().wait(0.01)
    assert asked == [0, 1]
    assert [o.path for o in outcomes] == ["w1", "w2"]


def test_an_error_comes_after_the_outcomes_before_it() -> None:
    asked: list[int] = []
    outcomes = embedded.EmbeddedClient().quantize(RECIPE, _tensors(3, asked, fail_at=1))
    assert next(outcomes).path == "w0"
    with pytest.raises(OSError, match="tensor 1 unreadable"):
        next(outcomes)


def test_a_tensor_the_engine_refuses_is_an_invalid_argument_in_its_place() -> None:
    bad = np.ones((8, 4), np.float32)
    bad[1, 2] = np.nan
    tensors = [("w0", np.ones((8, 4), np.float32)), ("w1", bad)]
    outcomes = embedded.EmbeddedClient().quantize(RECIPE, iter(tensors))
    assert next(outcomes).path == "w0"
    with pytest.raises(errors.QmillError, match="w1: tensor contains NaN") as refused:
        next(outcomes)
    assert refused.value.code == "INVALID_ARGUMENT"


@pytest.mark.parametrize("freeze", [False, True])
def test_load_engine_freezes_the_start_up_objects_only_when_asked(freeze: bool) -> None:
    # The CLI asks (a one-shot process: ~0.08 s less collection); a server must not, and the
    # collector is on again afterwards either way.
    code = (
        "import gc, sys; from qmill.checkpoints.run import embedded; "
        f"embedded.load_engine(freeze={freeze}); "
        "print(gc.get_freeze_count(), gc.isenabled(), 'jax' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    frozen, enabled, jax_loaded = done.stdout.split()
    assert (int(frozen) > 50_000) == freeze and (int(frozen) == 0) != freeze
    assert (enabled, jax_loaded) == ("True", "True")
