"""engine/programs: a model as a jax.export artifact, built on the client, run on the server.

Linen calibrate programs are checked against local SRQ (tests/srq_equal.py) by
tests/e2e/programs_cli_test.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import qmill.engine as qe
from qmill.engine.programs import build as program_build
from qmill.engine.programs import program as programs
from tests.srq_equal import STATIC_SCALE_RTOL

RULES = [qe.QuantizationRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]


class TwoInputs(nnx.Module):
    """An NNX model with two inputs that no registry knows."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.a = nnx.Linear(4, 8, rngs=rngs)
        self.b = nnx.Linear(3, 8, rngs=rngs)
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x: jax.Array, y: jax.Array) -> jax.Array:
        return self.out(jax.nn.relu(self.a(x) + self.b(y)))


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(2)(nn.relu(nn.Dense(6)(x)))


def _batches(n: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (rng.normal(size=(5, 4)).astype(np.float32), rng.normal(size=(5, 3)).astype(np.float32))
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def nnx_program() -> tuple[TwoInputs, bytes, dict]:
    model = TwoInputs(nnx.Rngs(0))
    data, params = program_build.calibration_program(model, RULES, *_batches(1)[0])
    return model, data, params


def _run(data: bytes, params: dict, batches) -> dict:
    program = programs.load(data)
    step = programs.calibrate_step(program)
    p = programs.tree_from_flat(program.params, params, "params")
    stats = programs.zero_stats(program)
    for batch in batches:
        stats = step(p, stats, *programs.check_inputs(program, batch))
    return stats


def test_nnx_program_stats_and_scales_equal_local_srq(nnx_program) -> None:
    model, data, params = nnx_program
    batches = _batches()
    stats = _run(data, params, batches)
    # Local SRQ: the QT model calibrated on the same batches, then quantize_params.
    local = qe.quantize_model(model, qe.QtProvider(RULES), *batches[0])
    step = nnx.jit(lambda m, x, y: m(x, y))  # jitted, as a local calibration loop runs
    for batch in batches:
        step(local, *batch)
    local_stats = nnx.to_pure_dict(nnx.state(local, qe.QuantStat))
    # Equal to float32 rounding (tests/srq_equal.py says why).
    for path, value in programs.flat_paths(local_stats).items():
        np.testing.assert_allclose(programs.flat_paths(stats)[path], value, STATIC_SCALE_RTOL)
    ptq = qe.quantize_model(model, qe.PtqProvider(RULES), *batches[0])
    float_params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    want = programs.flat_paths(qe.quantize_params(float_params, ptq, local_stats))
    scales = programs.static_scales(stats, programs.load(data).stat_qtypes)
    assert set(scales) == {p for p in want if "_lhs_scale" in p}
    for path, value in scales.items():
        np.testing.assert_allclose(value, want[path], STATIC_SCALE_RTOL)


class Siblings(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.Dense(6, name="pre")(x)
        w = self.param("w", nn.initializers.normal(), (6, 2))
        return nn.Dense(2, name="left")(h) * jnp.dot(h, w)


def test_odml_statistics_give_every_ptq_op_its_scale() -> None:
    # An ODML calibration names statistics as the reference (issue 40): "left" and the jnp.dot
    # read one tensor and share left's statistic, the dot is "dot0" where PTQ counts it as a
    # dot_general. The header's aliases give each PTQ op its static scale.
    x = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    data, params = program_build.calibration_program(Siblings(), RULES, x)
    program = programs.load(data)
    assert set(program.stat_qtypes) == {"pre/dot_general0_lhs", "left/dot_general0_lhs"} | {
        "final_output0"
    }
    assert program.stat_aliases == {
        "left/dot_general0_lhs": ("dot_general0_lhs", "left/dot_general0_lhs")
    }
    stats = _run(data, params, [(x,)])
    scales = programs.static_scales(stats, program.stat_qtypes, program.stat_aliases)
    assert set(scales) == {
        f"{p}_lhs_scale/array" for p in ("pre/dot_general0", "left/dot_general0", "dot_general0")
    }
    np.testing.assert_array_equal(
        scales["dot_general0_lhs_scale/array"], scales["left/dot_general0_lhs_scale/array"]
    )
    # They are the keys of the PTQ model's params.
    ptq = qe.quantize_model(Siblings(), qe.PtqProvider(RULES))
    abstract = jax.eval_shape(ptq.init, jax.random.key(0), x)["params"]
    flat = programs.flat_paths(abstract)
    assert set(scales) <= {p.removesuffix("/value") for p in flat} | set(flat)


def test_load_refuses_bad_artifacts(nnx_program) -> None:
    _, data, _ = nnx_program
    with pytest.raises(programs.ProgramError, match="over this server's limit"):
        programs.load(data, max_bytes=len(data) - 1)
    with pytest.raises(programs.ProgramError, match="wrong magic"):
        programs.load(b"PK\x03\x04" + data)
    with pytest.raises(programs.ProgramError, match="malformed"):
        programs.load(data[:-200])
    with pytest.raises(programs.ProgramError, match="runs on rocm"):
        programs.load(data, platform="rocm")
    assert programs.load(data, platform="gpu").kind == programs.CALIBRATE  # cuda is built in


def test_check_inputs_says_what_to_send(nnx_program) -> None:
    program = programs.load(nnx_program[1])
    x, y = _batches(1)[0]
    with pytest.raises(programs.ProgramError, match="2 tensor"):
        programs.check_inputs(program, [x])
    with pytest.raises(programs.ProgramError, match=r"takes \[5, 3\]"):
        programs.check_inputs(program, [x, y[:, :2]])
    with pytest.raises(programs.ProgramError, match="dtype int32"):
        programs.check_inputs(program, [x, y.astype(np.int32)])
    bad = y.copy()
    bad[3, 1] = np.inf
    with pytest.raises(programs.ProgramError, match="first: example 3"):
        programs.check_inputs(program, [x, bad])
    # float64 is cast to the program's float32.
    assert programs.check_inputs(program, [x.astype(np.float64), y])[0].dtype == np.float32


def test_params_must_fit(nnx_program) -> None:
    program = programs.load(nnx_program[1])
    params = dict(nnx_program[2])
    params["a/kernel"] = params["a/kernel"][:, :4]
    params.pop("b/bias")
    with pytest.raises(programs.ProgramError, match=r"missing \['b/bias'\].*a/kernel: \[4, 4\]"):
        programs.tree_from_flat(program.params, params, "params")


def test_export_program_is_cpu_only_and_has_composites() -> None:
    module = Mlp()
    x = np.ones((1, 3), np.float32)
    params = module.init(jax.random.key(0), x)["params"]
    rules = [qe.QuantizationRule(weight_qtype="int8")]
    data = program_build.export_program(module, rules, x, params=params)
    program = programs.load(data)
    assert program.kind == programs.EXPORT and program.inputs[0].shape == (1, 3)
    assert "quant.fake_quant" in program.exported.mlir_module()
    out = program.exported.call(jnp.asarray(x))
    np.testing.assert_allclose(out, module.apply({"params": params}, x), atol=0.05)
