"""Remote calibration of a model no registry knows (an NNX model with two inputs), sent as a
program, then static-range QuantizeParams: equal to local SRQ with the same batches
(tests/srq_equal.py)."""

from __future__ import annotations

import pathlib

import jax
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

import qmill.engine as qe
from qmill.client import Client, errors
from qmill.client import calibrate as client_calibrate
from qmill.client import programs as client_programs
from qmill.engine.programs import build as program_build
from qmill.engine.programs import program as programs
from qmill.proto.v1 import qmill_pb2 as pb
from tests import srq_equal

RULES = [qe.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]


class TwoInputs(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.image = nnx.Linear(12, 16, rngs=rngs)
        self.meta = nnx.Linear(3, 16, rngs=rngs)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x: jax.Array, m: jax.Array) -> jax.Array:
        return self.head(jax.nn.relu(self.image(x) + self.meta(m)))


def _batches(n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        (rng.normal(size=(8, 12)).astype(np.float32), rng.uniform(size=(8, 3)).astype(np.float32))
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def setup(make_server, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("data")
    running = make_server(data_dir=str(data_dir))
    model = TwoInputs(nnx.Rngs(0))
    program, params = program_build.calibration_program(model, RULES, *_batches(1)[0])
    with Client(running.address) as client:
        upload = client.upload(safetensors.numpy.save(params))
        yield client, model, program, upload.upload_id, data_dir


def _start(program: bytes, upload_id: str, **kw) -> pb.CalibrateStart:
    return pb.CalibrateStart(program=program, params_upload_id=upload_id, **kw)


def _local_srq(model: TwoInputs, batches) -> dict[str, np.ndarray]:
    """Local SRQ: the QT model calibrated (jitted) on the batches, then quantize_params."""
    local = qe.quantize_model(model, qe.QtProvider(RULES), *batches[0])
    step = nnx.jit(lambda m, x, y: m(x, y))
    for batch in batches:
        step(local, *batch)
    stats = nnx.to_pure_dict(nnx.state(local, qe.QuantStat))
    ptq = qe.quantize_model(model, qe.PtqProvider(RULES), *batches[0])
    floats = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return programs.flat_paths(qe.quantize_params(floats, ptq, stats))


def _remote_params(outcomes, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """QuantizeParams outcomes in the PTQ layout (P/array/qvalue, P/array/scale; kept: P)."""
    out = {}
    for o in outcomes:
        if o.quantized:
            out[f"{o.path}/array/qvalue"] = o.parts["qvalue"]
            out[f"{o.path}/array/scale"] = o.parts["scale"]
        else:
            out[o.path] = o.parts["value"] if o.parts else params[o.path]
    return out


def test_remote_calibrate_and_srq_equal_local_srq(setup) -> None:
    client, model, program, upload_id, _ = setup
    batches = _batches(3, seed=1)
    first = client.calibrate(_start(program, upload_id), batches[:2])
    cid = first.summary.calibration_id
    # The continuation names the program by upload (as one over the message limit travels).
    start = pb.CalibrateStart(
        program_upload_id=client_programs.upload_program(client, program),
        params_upload_id=upload_id,
        calibration_id=cid,
    )
    second = client.calibrate(start, batches[2:])
    assert (second.summary.batches_total, second.summary.examples_total) == (3, 24)

    want = _local_srq(model, batches)
    _, floats = program_build.calibration_program(model, RULES, *batches[0])
    ranges = client_calibrate.static_ranges(calibration_id=cid)
    got = _remote_params(client.quantize_upload("int8", upload_id, static_ranges=ranges), floats)
    srq_equal.assert_srq_equal(got, want)

    # The same statistics sent inline (no calibration id) give the same scales.
    qtypes = programs.load(program).stat_qtypes
    inline = client_calibrate.static_ranges(stats=second.stats, act_qtypes=qtypes)
    tensors = [("head/kernel", floats["head/kernel"])]
    by_path = {o.path: o for o in client.quantize("int8", tensors, static_ranges=inline)}
    for path in ("image/dot_general0_lhs_scale/array", "head/dot_general0_lhs_scale/array"):
        np.testing.assert_allclose(
            by_path[path].parts["value"], want[path], srq_equal.STATIC_SCALE_RTOL
        )


def _calibrations(data_dir: pathlib.Path) -> list[str]:
    return sorted(p.name for p in (data_dir / "calibrations").glob("*"))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("malformed", "malformed"),
        ("platform", "built for ['cuda']"),
        ("shape", "takes [8, 3]"),
        ("count", "ended inside a batch"),
        ("nan", "NaN or Inf values in 1 example(s) (first: example 5)"),
        ("not-a-program", "is not a program"),
    ],
)
def test_bad_programs_and_batches_are_invalid_argument(setup, case, message) -> None:
    client, model, program, upload_id, data_dir = setup
    before = _calibrations(data_dir)
    x, m = _batches(1, seed=2)[0]
    batches = [(x, m)]
    if case == "malformed":
        program = program[:-100]
    elif case == "platform":
        program, _ = program_build.calibration_program(model, RULES, x, m, platforms=("cuda",))
    elif case == "shape":
        batches = [(x, m[:, :2])]
    elif case == "count":
        batches = [x]  # one tensor of the two a batch needs
    else:
        m = m.copy()
        m[5, 0] = np.nan
        batches = [(x, m)]
    start = _start(program, upload_id)
    if case == "not-a-program":  # the params upload named as the program
        start = pb.CalibrateStart(program_upload_id=upload_id, params_upload_id=upload_id)
    with pytest.raises(errors.QmillError) as exc:
        client.calibrate(start, batches)
    assert exc.value.code == "INVALID_ARGUMENT" and message in exc.value.details
    assert _calibrations(data_dir) == before  # nothing stored
    # The server keeps serving: a good call right after works.
    assert client.calibrate(_start(setup[2], upload_id), _batches(1)).summary.batches_total == 1


def test_static_ranges_errors(setup) -> None:
    client, _, _, upload_id, _ = setup
    with pytest.raises(errors.QmillError) as exc:
        list(client.quantize_upload("int8", upload_id, static_ranges=pb.StaticRanges()))
    assert exc.value.code == "INVALID_ARGUMENT" and "set calibration_id or" in exc.value.details
    missing = client_calibrate.static_ranges(calibration_id="0123456789abcdef01234567")
    with pytest.raises(errors.QmillError) as exc:
        list(client.quantize_upload("int8", upload_id, static_ranges=missing))
    assert exc.value.code == "NOT_FOUND"
    stats = {"head/dot_general0_lhs/count": np.int32(1)}
    no_qtype = client_calibrate.static_ranges(stats=stats)
    with pytest.raises(errors.QmillError) as exc:
        list(client.quantize_upload("int8", upload_id, static_ranges=no_qtype))
    assert exc.value.code == "INVALID_ARGUMENT" and "act_qtypes has no entry" in exc.value.details
