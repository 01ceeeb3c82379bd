"""`qmill upload` and `qmill calibrate` as a user runs them, against a real server on loopback."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from qmill import checkpoints
from qmill.cli import model_rules
from qmill.client import Client
from qmill.engine import zoo
from qmill.proto.v1 import qmill_pb2 as pb
from tests import digits_data, flax_npz


@pytest.fixture(scope="module")
def setup(make_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    running = make_server(data_dir=str(tmp / "data"))
    x = digits_data.images()[:96]
    params = zoo.BUILTIN["cnn"].build(zoo.CnnConfig()).init(jax.random.key(0), x[:1])
    flax_npz.save(tmp / "cnn.npz", params["params"])
    np.save(tmp / "first.npy", x[:48])
    np.save(tmp / "second.npy", x[48:])
    return running.address, tmp, x


def test_calibrate_in_two_runs_equals_one_call_and_writes_ptq_params(setup, run_qmill):
    address, tmp, x = setup
    up = run_qmill("upload", str(tmp / "cnn.npz"), "--server", address)
    assert up.returncode == 0, up.stderr
    upload_id = up.stdout.split()[-1]
    common = ["--server", address, "--model", "cnn", "--config", '{"hidden": 64}']
    first = run_qmill(
        "calibrate", *common, "--params-upload-id", upload_id, "--batches", str(tmp / "first.npy"),
        "--batch-size", "16",
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    assert "3 batches, 48 examples in total" in first.stdout
    cid = first.stdout.split("calibration ", 1)[1].split(":", 1)[0]
    # The second run: params named by path (same bytes: not stored again), rules from TOML
    # spelling out the preset the first run used.
    (tmp / "rules.toml").write_text(
        '[[rules]]\nweight_qtype = "int8"\nact_qtype = "int8"\nact_static_scale = true\n'
    )
    second = run_qmill(
        "calibrate", *common, "--params", str(tmp / "cnn.npz"), "--batches",
        str(tmp / "second.npy"), "--batch-size", "16", "--calibration-id", cid, "--rules",
        str(tmp / "rules.toml"), "--stats-output", str(tmp / "stats.npz"), "--ptq-output",
        str(tmp / "ptq"),
    )  # fmt: skip
    assert second.returncode == 0, second.stderr
    assert f"calibration {cid}: 6 batches, 96 examples in total" in second.stdout
    assert f"upload {upload_id}" not in second.stdout  # a new upload id, the same content
    assert "already on the server, none sent" in second.stdout

    # The same six batches in one call, through the library: the stats are equal bit for bit.
    with Client(address) as client:
        start = pb.CalibrateStart(
            model=pb.ModelSpec(name="cnn"),
            params_upload_id=upload_id,
            rules=model_rules.load_rules("w8a8-static"),
        )
        one = client.calibrate(start, np.split(x, 6))
    with np.load(tmp / "stats.npz") as merged:
        assert sorted(merged.files) == sorted(one.stats)
        for path, value in one.stats.items():
            assert merged[path].dtype == value.dtype
            np.testing.assert_array_equal(merged[path], value, err_msg=path)
    assert int(one.stats["Conv_0/conv_general_dilated0_lhs/count"]) == 6

    with checkpoints.open_source(tmp / "ptq") as ptq:
        entries = {e.path: e for e in ptq.entries()}
        qvalue = ptq.read("Dense_0/kernel/array/qvalue")
    assert entries["Dense_0/kernel/array/scale"].shape[-1] == 64
    assert qvalue.dtype == np.int8 and qvalue.shape == (2048, 64)
    assert "Dense_0/bias" in entries


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "resnet"], "model 'resnet' not found"),
        (["--model", "cnn", "--config", '{"width": 2}'], "unknown config field(s) ['width']"),
        (["--model", "cnn", "--rules", "w9a9"], "neither a preset"),
    ],
)
def test_calibrate_errors_print_one_line(setup, run_qmill, args, message):
    address, tmp, _ = setup
    result = run_qmill(
        "calibrate", "--server", address, "--params", str(tmp / "cnn.npz"), "--batches",
        str(tmp / "first.npy"), *args,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.startswith("qmill: error:") and message in result.stderr
    assert "Traceback" not in result.stderr
