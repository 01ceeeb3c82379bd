"""Calibrate through a real server: the zoo CNN, params uploaded once, stats merged exactly."""

import jax
import numpy as np
import pytest
import safetensors.numpy
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from qmill.client import Client, errors
from qmill.engine import zoo
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc
from tests import digits_data

W8A8 = [pb.ModelRule(weight_qtype="int8", act_qtype="int8", act_static_scale=True)]
CNN = pb.ModelSpec(name="cnn", config_json="{}")


def _upload_cnn(client, x) -> str:
    model = zoo.BUILTIN["cnn"].build(zoo.CnnConfig())
    params = model.init(jax.random.key(0), x[:1])["params"]
    flat = {
        f"{layer}/{name}": np.asarray(v) for layer, d in params.items() for name, v in d.items()
    }
    status = client.upload(safetensors.numpy.save(flat))
    assert status.complete
    return status.upload_id


@pytest.fixture(scope="module")
def setup(make_server, tmp_path_factory):
    running = make_server(data_dir=str(tmp_path_factory.mktemp("data")), reflection=True)
    client = Client(running.address)
    x = digits_data.images()[:96]
    yield client, _upload_cnn(client, x), x
    client.close()


def _start(upload_id, **kw):
    return pb.CalibrateStart(model=CNN, params_upload_id=upload_id, rules=W8A8, **kw)


def test_two_calls_merge_exactly_into_the_one_call_stats(setup):
    client, uid, x = setup
    batches = np.split(x, 4)
    one = client.calibrate(_start(uid), batches)
    first = client.calibrate(_start(uid), batches[:2])
    cid = first.summary.calibration_id
    second = client.calibrate(_start(uid, calibration_id=cid), batches[2:])
    assert second.summary.calibration_id == cid
    assert second.summary.batches_total == 4 and second.summary.examples_total == len(x)
    assert set(one.stats) == set(second.stats) and "final_output0/count" in one.stats
    for path, value in one.stats.items():
        assert value.dtype == second.stats[path].dtype
        np.testing.assert_array_equal(value, second.stats[path], err_msg=path)
    assert int(one.stats["Dense_0/dot_general0_lhs/count"]) == 4
    assert not np.array_equal(first.stats["Dense_0/dot_general0_lhs/sum_of_absmax"], 0)


def test_ptq_params_come_back_quantized(setup):
    client, uid, x = setup
    result = client.calibrate(_start(uid, return_ptq_params=True), [x[:32]])
    kernel = result.params["Dense_0/kernel"]
    assert kernel["qvalue"].dtype == np.int8 and kernel["qvalue"].shape == (2048, 64)
    assert kernel["scale"].shape[-1] == 64
    assert result.results["Dense_0/kernel"].quality.sqnr_db > 30
    assert "value" in result.params["Dense_0/bias"]
    # Server-made float tensors come as FLOAT with their bytes; KEPT would mean "no bytes".
    assert result.results["Dense_0/kernel"].kind == pb.RESULT_KIND_QUANTIZED
    assert result.results["Dense_0/bias"].kind == pb.RESULT_KIND_FLOAT
    assert [h.path for h in result.results["Dense_0/bias"].parts] == ["value"]
    assert {r.kind for r in result.results.values()} == {
        pb.RESULT_KIND_QUANTIZED,
        pb.RESULT_KIND_FLOAT,
    }


def test_quantize_params_with_the_calibration_id_gives_calibrates_ptq_params(setup):
    """The model-free path with static ranges (SRQ) and Calibrate's own PTQ params agree bit
    for bit: the same weights, the same activation scales."""
    client, uid, x = setup
    result = client.calibrate(_start(uid, return_ptq_params=True), np.split(x[:64], 2))
    ranges = pb.StaticRanges(calibration_id=result.summary.calibration_id)
    outcomes = {o.path: o for o in client.quantize_upload("int8", uid, static_ranges=ranges)}
    scales = [p for p in result.params if p.endswith("_scale/array")]
    assert scales and all(p in outcomes for p in scales)
    for path, parts in result.params.items():
        got = outcomes[path].parts
        for name, value in parts.items():
            if name == "value" and not got:  # kept float params (biases): the client has them
                continue
            np.testing.assert_array_equal(got[name], value, err_msg=f"{path}/{name}")


@pytest.mark.parametrize(
    ("start", "code"),
    [
        (dict(model=pb.ModelSpec(name="resnet")), "NOT_FOUND"),
        (dict(model=pb.ModelSpec(name="cnn", config_json='{"width": 1}')), "INVALID_ARGUMENT"),
        (dict(model=pb.ModelSpec(name="cnn", config_json='{"hidden": 32}')), "FAILED_PRECONDITION"),
        (dict(model=CNN, calibration_id="abc123"), "NOT_FOUND"),
        (dict(model=CNN, rules=[pb.ModelRule(weight_qtype="int8")]), "INVALID_ARGUMENT"),
        (dict(model=CNN, params_upload_id="feedbeef"), "NOT_FOUND"),
    ],
)
def test_errors_name_the_problem(setup, start, code):
    client, uid, x = setup
    fields = {"params_upload_id": uid, "rules": W8A8, **start}
    with pytest.raises(errors.QmillError) as info:
        client.calibrate(pb.CalibrateStart(**fields), [x[:8]])
    assert info.value.code == code, info.value.details


def test_a_batch_of_the_wrong_shape_is_invalid_argument(setup):
    client, uid, x = setup
    with pytest.raises(errors.QmillError, match=r"takes \[batch, 8, 8, 1\]") as info:
        client.calibrate(_start(uid), [x[:4, :4]])
    assert info.value.code == "INVALID_ARGUMENT"


def test_a_batch_with_nan_is_refused_and_leaves_the_calibration_as_it_was(setup):
    client, uid, x = setup
    batches = np.split(x, 4)
    one = client.calibrate(_start(uid), batches)
    cid = client.calibrate(_start(uid), batches[:2]).summary.calibration_id
    spoiled = batches[2].copy()
    spoiled[5, 3, 4, 0] = np.nan
    with pytest.raises(
        errors.QmillError, match=r"NaN or Inf .* 1 example\(s\) \(first: example 5\)"
    ) as info:
        client.calibrate(_start(uid, calibration_id=cid), [batches[2], spoiled])
    assert info.value.code == "INVALID_ARGUMENT"
    after = client.calibrate(_start(uid, calibration_id=cid), batches[2:])
    assert after.summary.batches_total == 4
    for path, value in one.stats.items():
        np.testing.assert_array_equal(value, after.stats[path], err_msg=path)


def test_capabilities_list_the_models(setup):
    client, _, _ = setup
    caps = pb_grpc.QuantizerStub(client.channel).GetCapabilities(pb.GetCapabilitiesRequest())
    assert {"cnn", "mlp", "transformer_encoder"} <= {m.name for m in caps.models}
    assert caps.max_upload_bytes > 0


def test_reflection_lists_the_new_services(setup):
    client, _, _ = setup
    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    (response,) = list(stub.ServerReflectionInfo(iter([request])))
    names = {s.name for s in response.list_services_response.service}
    assert {"qmill.v1.Uploads", "qmill.v1.Calibrator", "qmill.v1.Quantizer"} <= names


def test_batches_count_against_the_inflight_limit(make_server, setup, tmp_path):
    _, _, x = setup
    batch_bytes = 8 * 8 * 8 * 4  # 8 examples of 8x8x1 float32
    running = make_server(
        data_dir=str(tmp_path),
        max_inflight_bytes=2 * batch_bytes,
        max_tenant_inflight_bytes=2 * batch_bytes,
    )
    limiter = running.server.limiter
    with Client(running.address) as client:
        uid = _upload_cnn(client, x)
        # A batch over the limit is refused at once, like a tensor of QuantizeParams.
        with pytest.raises(errors.QmillError) as info:
            client.calibrate(_start(uid), [x[:32]])
        assert info.value.code == "RESOURCE_EXHAUSTED"
        assert f"{4 * batch_bytes} bytes requested at once" in info.value.details
        assert limiter.used == 0
        # Batches within it: each counted while held, then given back.
        result = client.calibrate(_start(uid), np.split(x[:32], 4))
    assert result.summary.batches_total == 4
    assert limiter.peak == batch_bytes and limiter.used == 0 and not limiter.by_tenant
