"""server/calibrator/program_session: programs from requests, cached, run on this device."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flax import nnx

import qmill.engine as qe
from qmill.engine.programs import build as program_build
from qmill.engine.programs import program as programs
from qmill.server import errors
from qmill.server.calibrator import program_session

RULES = [qe.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]


@dataclasses.dataclass
class _Stored:
    """A stand-in for an upload's StoredTensor."""

    path: str
    dtype: np.dtype
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def read(self) -> np.ndarray:
        return self.data


@pytest.fixture(scope="module")
def artifact() -> tuple[bytes, dict]:
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    return program_build.calibration_program(model, RULES, np.ones((4, 3), np.float32))


def _tensors(*stored: _Stored):
    return lambda tenant, upload_id: list(stored)


def test_program_bytes_inline_or_from_an_upload(artifact) -> None:
    data, _ = artifact
    assert program_session.program_bytes(data, "", _tensors(), "t", 1 << 20) == data
    as_upload = _Stored("program", np.dtype(np.uint8), np.frombuffer(data, np.uint8))
    assert program_session.program_bytes(b"", "u1", _tensors(as_upload), "t", 1 << 20) == data
    with pytest.raises(ValueError, match="not both"):
        program_session.program_bytes(data, "u1", _tensors(as_upload), "t", 1 << 20)
    params = _Stored("kernel", np.dtype(np.float32), np.ones(3, np.float32))
    with pytest.raises(ValueError, match="is not a program"):
        program_session.program_bytes(b"", "u1", _tensors(params), "t", 1 << 20)
    # Oversized: refused from the upload's index, before its bytes are read.
    with pytest.raises(programs.ProgramError, match="over this server's limit of 100"):
        program_session.program_bytes(b"", "u1", _tensors(as_upload), "t", 100)


def test_load_is_cached_by_content(artifact) -> None:
    data, _ = artifact
    first = program_session.load(data, max_bytes=1 << 20, platform="cpu")
    assert program_session.load(bytes(data), max_bytes=1 << 20, platform="cpu") is first
    with pytest.raises(programs.ProgramError, match="over this server's limit"):
        program_session.load(data, max_bytes=10, platform="cpu")


def test_session_adds_batches_and_refuses_other_params(artifact) -> None:
    data, params = artifact
    program = program_session.load(data, max_bytes=1 << 20, platform="cpu")
    session = program_session.ProgramSession(program, params, None)
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    session.add_batch([x])
    session.add_batch([2 * x])
    assert (session.batches, session.examples) == (2, 8)
    stats = programs.flat_paths(session.host_stats())
    assert int(stats["dot_general0_lhs/count"]) == 2
    with pytest.raises(errors.FailedPrecondition, match="missing"):
        program_session.ProgramSession(program, {"kernel": params["kernel"]}, None)
