"""QuantizeParams through a real server on loopback: results, bit-exactness, bad input."""

from __future__ import annotations

import grpc
import ml_dtypes
import numpy as np
import pytest

from qmill import checkpoints
from qmill.checkpoints.formats import examples
from qmill.checkpoints.run import embedded, pipeline
from qmill.client import AsyncClient, Client, errors, streaming
from qmill.proto import recipe as recipe_proto
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc

INT8 = {"rules": [{"path_regex": ".*", "qtype": "int8"}]}


def _tensors(seed=0):
    rng = np.random.default_rng(seed)
    return [
        ("params/a/kernel", rng.normal(size=(64, 32)).astype(np.float32)),
        ("params/a/bias", rng.normal(size=(32,)).astype(np.float32)),
        ("params/b/kernel", rng.normal(size=(32, 16)).astype(ml_dtypes.bfloat16)),
    ]


def _read_all(path):
    with checkpoints.open_source(path) as source:
        return {e.path: source.read(e.path) for e in source.entries()}


def test_capabilities_describe_the_server(server):
    with Client(server.address) as client:
        caps = client.capabilities()
    assert {"int8", "int4", "float8_e4m3fn"} <= set(caps.qtypes)
    assert "absmax" in caps.calibration_methods and "minmax" in caps.calibration_methods
    assert caps.device_kind == "cpu"
    assert pb.DTYPE_BF16 in caps.wire_dtypes
    assert caps.max_chunk_bytes == wire.MAX_CHUNK_BYTES


def test_remote_outcomes_equal_embedded_outcomes(server):
    recipe = {
        "rules": [
            {"path_regex": ".*b/kernel", "qtype": "int4", "tile_size": 16},
            {"path_regex": ".*", "qtype": "int8", "calibration_method": "minmax"},
        ]
    }
    with Client(server.address) as client:
        remote_out = list(client.quantize(recipe, _tensors()))
    embedded_out = list(embedded.EmbeddedClient().quantize(recipe, _tensors()))
    assert [o.path for o in remote_out] == [p for p, _ in _tensors()]
    for r, e in zip(remote_out, embedded_out, strict=True):
        assert r.quantized == e.quantized and r.how == e.how
        assert r.parts.keys() == e.parts.keys()
        for name in r.parts:
            assert r.parts[name].dtype == e.parts[name].dtype
            assert np.asarray(r.parts[name]).tobytes() == np.asarray(e.parts[name]).tobytes()
        if r.quantized:
            assert r.sqnr_db == pytest.approx(e.sqnr_db)
    kernel = remote_out[0]
    assert kernel.parts["qvalue"].dtype == np.int8 and "zero_point" in kernel.parts
    assert remote_out[2].parts["qvalue"].dtype == ml_dtypes.int4
    assert remote_out[2].parts["scale"].shape == (2, 16)
    # A kept tensor comes back as a reason and no bytes: the caller still has it.
    assert not remote_out[1].quantized and remote_out[1].parts == {} and remote_out[1].reason


def test_each_result_streams_back_before_the_next_tensor_is_sent(server):
    # A one-byte window sends tensor k+1 only after tensor k's answer arrived: the call can only
    # finish if the server answers tensors one by one rather than at the end.
    tensors = [(f"t{i}/kernel", np.full((8, 8), i + 1, np.float32)) for i in range(4)]
    with Client(server.address, timeout=60) as client:
        outcomes = list(client.quantize(INT8, tensors, window_bytes=1))
    assert [o.path for o in outcomes] == [p for p, _ in tensors]


@pytest.mark.parametrize("fmt", ["orbax", "safetensors"])
def test_checkpoint_through_server_is_bit_identical_to_in_process(server, tmp_path, fmt):
    source = tmp_path / "src"
    examples.write_example_checkpoint(source, format=fmt)
    if fmt == "safetensors":
        source = next(tmp_path.glob("src*")) if not source.exists() else source
    recipe = {
        "rules": [{"path_regex": ".*", "qtype": "int4", "tile_size": 32, "tile_if_divisible": True}]
    }
    with Client(server.address) as client:
        rows = pipeline.quantize_checkpoint(source, tmp_path / "remote", recipe, backend=client)
    pipeline.quantize_checkpoint(
        source, tmp_path / "local", recipe, backend=embedded.EmbeddedClient()
    )
    remote_tree, local_tree = _read_all(tmp_path / "remote"), _read_all(tmp_path / "local")
    assert remote_tree.keys() == local_tree.keys()
    for key in remote_tree:
        assert remote_tree[key].dtype == local_tree[key].dtype, key
        assert remote_tree[key].tobytes() == local_tree[key].tobytes(), key
    assert any(r.qtype == "int4" for r in rows)
    assert any(k.endswith("array/qvalue") or k.endswith("array.qvalue") for k in remote_tree)


def _raw_call(server, requests):
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.QuantizerStub(channel)
        return list(stub.QuantizeParams(iter(requests), timeout=30))


def _recipe_request(mapping=INT8):
    return pb.QuantizeParamsRequest(recipe=recipe_proto.from_mapping(mapping))


def _tensor_requests(array, path="w/kernel"):
    return list(streaming.tensor_requests(path, array))


BAD_INPUTS = {
    "unknown qtype": (
        [
            _recipe_request({"rules": [{"qtype": "int9"}]}),
            *_tensor_requests(np.ones((4, 4), np.float32)),
        ],
        grpc.StatusCode.INVALID_ARGUMENT,
        "int9",
    ),
    "bad regex": (
        [_recipe_request({"rules": [{"path_regex": "([", "qtype": "int8"}]})],
        grpc.StatusCode.INVALID_ARGUMENT,
        "not a valid regex",
    ),
    "no recipe first": (
        _tensor_requests(np.ones((4, 4), np.float32)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "first message must be the recipe",
    ),
    "wrong byte length": (
        [
            _recipe_request(),
            pb.QuantizeParamsRequest(
                header=pb.TensorHeader(path="w", dtype=pb.DTYPE_F32, shape=[4, 4], byte_length=63)
            ),
        ],
        grpc.StatusCode.INVALID_ARGUMENT,
        "byte_length 63",
    ),
    "truncated stream": (
        [_recipe_request(), *_tensor_requests(np.ones((4, 4), np.float32))[:1]],
        grpc.StatusCode.DATA_LOSS,
        "stream ended after 0 of 64 bytes",
    ),
    "crc mismatch": (
        [
            _recipe_request(),
            pb.QuantizeParamsRequest(
                header=pb.TensorHeader(
                    path="w", dtype=pb.DTYPE_F32, shape=[2], byte_length=8, crc32c=1
                )
            ),
            pb.QuantizeParamsRequest(chunk=pb.TensorChunk(offset=0, data=b"\0" * 8)),
        ],
        grpc.StatusCode.DATA_LOSS,
        "crc32c",
    ),
    "nan input": (
        [_recipe_request(), *_tensor_requests(np.full((4, 4), np.nan, np.float32))],
        grpc.StatusCode.INVALID_ARGUMENT,
        "NaN",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gets_a_clear_status_and_the_server_keeps_serving(server, case):
    requests, code, message = BAD_INPUTS[case]
    with pytest.raises(grpc.RpcError) as e:
        _raw_call(server, requests)
    assert e.value.code() == code
    assert message in e.value.details()
    # The next call on the same server works.
    with Client(server.address) as client:
        (outcome,) = client.quantize(INT8, [("w/kernel", np.ones((4, 4), np.float32))])
    assert outcome.quantized


def test_client_errors_are_qmill_errors(server):
    with Client(server.address) as client, pytest.raises(errors.QmillError) as e:
        list(
            client.quantize(
                {"rules": [{"qtype": "int8", "tile_size": 3}]},
                [("w/kernel", np.ones((4, 4), np.float32))],
            )
        )
    assert e.value.code == "INVALID_ARGUMENT" and "tile size 3" in e.value.details


def test_async_client_matches_sync_client(server):
    import asyncio

    async def run():
        async with AsyncClient(server.address) as client:
            return [o async for o in client.quantize(INT8, _tensors())]

    async_out = asyncio.run(run())
    with Client(server.address) as client:
        sync_out = list(client.quantize(INT8, _tensors()))
    for a, s in zip(async_out, sync_out, strict=True):
        assert a.path == s.path and a.quantized == s.quantized
        for name in a.parts:
            assert a.parts[name].tobytes() == s.parts[name].tobytes()


def test_every_qtype_the_server_offers_travels_back(server):
    """Each advertised qtype's parts have a wire dtype and arrive bit-identical to the engine's."""
    x = np.random.default_rng(3).normal(size=(64, 32)).astype(np.float32)
    with Client(server.address) as client:
        qtypes = list(client.capabilities().qtypes)
        for qtype in qtypes:
            tile = 16 if qtype in ("mxfp8_16", "nvfp4") else 32  # the mx/nv formats fix their tile
            recipe = {
                "rules": [
                    {
                        "qtype": qtype,
                        "tile_size": tile,
                        "tile_if_divisible": True,
                        "contracting_axes": [1],
                        "channel_axes": [0],
                    }
                ]
            }
            (remote_out,) = client.quantize(recipe, [("w", x)])
            (local_out,) = embedded.EmbeddedClient().quantize(recipe, [("w", x)])
            assert remote_out.quantized, qtype
            for name, part in local_out.parts.items():
                assert remote_out.parts[name].dtype == part.dtype, (qtype, name)
                assert remote_out.parts[name].tobytes() == part.tobytes(), (qtype, name)
