"""Hypothesis-generated malformed QuantizeParams streams against a real server.

Every stream starts from a valid one (a recipe and one tensor) and gets at least one defect: bad
dtypes, shapes, byte counts, crc32c, chunk order and offsets, regexes, recipe values, or messages
in the wrong place. Each must end with a client-side error status (INVALID_ARGUMENT, DATA_LOSS,
OUT_OF_RANGE or RESOURCE_EXHAUSTED) with a message, never INTERNAL/UNKNOWN or a hang, and the
server must still answer health checks and quantize afterwards. 5,000 streams in all.
"""

from __future__ import annotations

import collections

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, assume, given
from hypothesis import strategies as st

from qmill.client import Client
from qmill.engine import qtypes
from qmill.proto import recipe as recipe_proto
from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc
from tests.integration import fuzzing

ALLOWED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
MAX_TENSOR_BYTES = 64 * 1024
VALID_DTYPES = sorted(wire.wire_dtypes())
TENSOR_DTYPES = [pb.DTYPE_F32, pb.DTYPE_BF16, pb.DTYPE_F16, pb.DTYPE_INT8, pb.DTYPE_INT4]
INT8 = {"rules": [{"qtype": "int8"}]}
# The wire-level cases keep every tensor (no engine work): they test the stream, and a jit compile
# per random shape would cost seconds. The recipe cases quantize a few fixed shapes.
KEEP_ALL = {"rules": [{"skip": True}]}


def _settings(n: int):
    # Derandomized: CI runs the same 5,000 streams every time, and a failure reproduces.
    return fuzzing.derandomized(n, HealthCheck.filter_too_much)


class Target:
    """One channel to the fuzzed server, and how many streams went through it."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.QuantizerStub(self.channel)
        self.address = address
        self.calls = 0
        self.codes: collections.Counter[str] = collections.Counter()

    def refuse(self, requests: list[pb.QuantizeParamsRequest]) -> grpc.StatusCode:
        """Sends a malformed stream; asserts it fails as a client error should."""
        self.calls += 1
        with pytest.raises(grpc.RpcError) as e:
            list(self.stub.QuantizeParams(iter(requests), timeout=30))
        code, details = e.value.code(), e.value.details() or ""
        assert code in ALLOWED, (code, details, requests[:3])
        assert details and details != "internal error", (code, details)
        self.codes[code.name] += 1
        return code


@pytest.fixture(scope="module")
def target(make_server):
    running = make_server(max_tensor_bytes=MAX_TENSOR_BYTES)
    t = Target(running.address)
    yield t
    # Afterwards the server answers health checks and still quantizes.
    health = health_pb2_grpc.HealthStub(t.channel).Check(
        health_pb2.HealthCheckRequest(), timeout=30
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    with Client(running.address, timeout=60) as client:
        (outcome,) = client.quantize(INT8, [("w/kernel", np.ones((8, 8), np.float32))])
    assert outcome.quantized
    assert running.server.limiter.used == 0  # no refused stream left bytes reserved
    if t.calls >= 5000:  # the whole module ran: every kind of refusal was reached
        assert {"INVALID_ARGUMENT", "DATA_LOSS", "RESOURCE_EXHAUSTED"} <= set(t.codes), t.codes
    print(f"fuzz: {t.calls} malformed streams refused with {dict(t.codes)}")
    t.channel.close()


def _recipe(mapping=None) -> pb.QuantizeParamsRequest:
    return pb.QuantizeParamsRequest(recipe=recipe_proto.from_mapping(mapping or KEEP_ALL))


@st.composite
def tensors(draw, dtypes=TENSOR_DTYPES):
    """(header, bytes) of a valid tensor: a small shape, random content of the right length."""
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(st.lists(st.integers(1, 12), min_size=1, max_size=3))
    n = wire.byte_length(dtype, tuple(shape))
    data = draw(st.binary(min_size=n, max_size=n))
    header = pb.TensorHeader(
        path=draw(st.sampled_from(["w/kernel", "layer/0/weight", "emb", "x"])),
        dtype=dtype,
        shape=shape,
        byte_length=n,
        crc32c=wire.crc32c(data),
    )
    return header, data


def _chunked(data: bytes, sizes: list[int]) -> list[pb.TensorChunk]:
    chunks, offset = [], 0
    for size in sizes:
        if offset >= len(data):
            break
        chunks.append(pb.TensorChunk(offset=offset, data=data[offset : offset + size]))
        offset += size
    if offset < len(data):
        chunks.append(pb.TensorChunk(offset=offset, data=data[offset:]))
    return chunks


def _stream(header, chunks, recipe=None):
    return [
        recipe or _recipe(),
        pb.QuantizeParamsRequest(header=header),
        *(pb.QuantizeParamsRequest(chunk=c) for c in chunks),
    ]


HEADER_DEFECTS = st.sampled_from(["dtype", "shape", "byte_length", "huge"])


@given(data=st.data(), tensor=tensors(), defect=HEADER_DEFECTS)
def _header_defects(target, data, tensor, defect):
    header, payload = tensor
    bad = pb.TensorHeader()
    bad.CopyFrom(header)
    if defect == "dtype":
        bad.dtype = data.draw(
            st.integers(-(2**31), 2**31 - 1).filter(lambda d: d not in VALID_DTYPES)
        )
    elif defect == "shape":
        shape = data.draw(st.lists(st.integers(-(2**40), 2**62), max_size=5))
        count = int(np.prod(np.array(shape, dtype=object))) if shape else 1
        # The same element count with non-negative dims is a valid reshape, not a defect.
        assume(not (all(d >= 0 for d in shape) and count == int(np.prod(header.shape))))
        del bad.shape[:]
        bad.shape.extend(shape)
    elif defect == "byte_length":
        bad.byte_length = data.draw(
            st.integers(0, 2**64 - 1).filter(lambda n: n != header.byte_length)
        )
    else:  # a consistent header for a tensor over the server's limit
        rows = data.draw(st.integers(MAX_TENSOR_BYTES // 4 + 1, 2**40))
        del bad.shape[:]
        bad.shape.extend([rows])
        bad.dtype = pb.DTYPE_F32
        bad.byte_length = rows * 4
    sizes = data.draw(st.lists(st.integers(1, 64), max_size=4))
    target.refuse(_stream(bad, _chunked(payload, sizes)))


CHUNK_DEFECTS = st.sampled_from(
    ["crc", "truncate", "extra_bytes", "reorder", "offset", "duplicate", "stray_chunk", "cut"]
)


@given(data=st.data(), tensor=tensors(), defect=CHUNK_DEFECTS)
def _chunk_defects(target, data, tensor, defect):
    header, payload = tensor
    chunks = _chunked(payload, data.draw(st.lists(st.integers(1, 16), min_size=1, max_size=8)))
    if defect == "crc":
        header.crc32c ^= data.draw(st.integers(1, 2**32 - 1))
    elif defect == "truncate":  # the stream ends before the announced bytes
        keep = data.draw(st.integers(0, len(payload) - 1))
        chunks = _chunked(payload[:keep], [16] * len(payload))
    elif defect == "extra_bytes":
        chunks[-1].data += data.draw(st.binary(min_size=1, max_size=32))
    elif defect == "reorder":
        assume(len(chunks) >= 2)
        order = data.draw(st.permutations(range(len(chunks))))
        assume(list(order) != sorted(order))
        chunks = [chunks[i] for i in order]
    elif defect == "offset":
        i = data.draw(st.integers(0, len(chunks) - 1))
        chunks[i].offset = data.draw(
            st.integers(0, 2**64 - 1).filter(lambda o: o != chunks[i].offset)
        )
    elif defect == "duplicate":
        i = data.draw(st.integers(0, len(chunks) - 1))
        chunks.insert(i + 1, chunks[i])
    elif defect == "stray_chunk":  # a chunk after the tensor is complete
        chunks.append(pb.TensorChunk(offset=len(payload), data=data.draw(st.binary(min_size=1))))
    else:  # a second header while the first tensor is incomplete
        cut = data.draw(st.integers(0, len(chunks) - 1))
        target.refuse([*_stream(header, chunks[:cut]), pb.QuantizeParamsRequest(header=header)])
        return
    target.refuse(_stream(header, chunks))


_NOT_A_METHOD = st.text("abcdeghijklnopqstuvwxyz_", min_size=1, max_size=12).filter(
    lambda s: s not in ("absmax", "minmax", "rms", "fixed")
)
RECIPE_DEFECTS = {
    # Unbalanced: a pattern with no backslash or bracket that ends in "(" never compiles.
    "path_regex": st.text("abc.*+?|^$", max_size=10).map(lambda s: s + "("),
    "qtype": st.text(min_size=1, max_size=12).filter(lambda s: s not in qtypes.names()),
    "tile_size": st.one_of(st.integers(-(2**63), -1), st.integers(33, 2**62)),
    "calibration_method": st.one_of(
        _NOT_A_METHOD,
        st.just("rms"),
        st.tuples(st.integers(1, 100), st.integers(-100, 0)).map(lambda t: f"fixed,{t[0]},{t[1]}"),
    ),
    "scale_dtype": st.sampled_from(["int8", "uint4", "bool", "float33", "complex64", "nope"]),
    "axes": st.integers(2, 2**31 - 1).flatmap(
        lambda a: st.sampled_from([a, -a - 1]).map(
            lambda x: {"contracting_axes": [x], "channel_axes": []}
        )
    ),
    "tiled_axes": st.one_of(
        st.integers(2, 2**31 - 1).map(lambda a: {a: 4}),
        st.integers(33, 2**62).map(lambda t: {0: t}),
    ),
}


@given(
    data=st.data(),
    shape=st.tuples(st.sampled_from([8, 16, 32]), st.sampled_from([8, 16, 32])),
    field=st.sampled_from([*RECIPE_DEFECTS, "convention"]),
)
def _recipe_defects(target, data, shape, field):
    array = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    payload = wire.to_bytes(array)
    header = wire.header_for("w/kernel", array, payload)
    if field == "convention":
        message = recipe_proto.from_mapping(INT8)
        message.convention = data.draw(st.integers(3, 2**31 - 1))
        recipe = pb.QuantizeParamsRequest(recipe=message)
    else:
        value = data.draw(RECIPE_DEFECTS[field])
        rule = {"qtype": "int8", **(value if field == "axes" else {field: value})}
        recipe = _recipe({"rules": [rule]})
    target.refuse(_stream(header, list(wire.chunks(payload)), recipe))


STRUCTURE_DEFECTS = st.sampled_from(["no_recipe", "recipe_twice", "empty", "chunk_first", "none"])


@given(data=st.data(), tensor=tensors(), defect=STRUCTURE_DEFECTS)
def _structure_defects(target, data, tensor, defect):
    header, payload = tensor
    stream = _stream(header, _chunked(payload, [7]))
    if defect == "no_recipe":
        stream = stream[1:]
    elif defect == "recipe_twice":
        stream.insert(data.draw(st.integers(1, len(stream))), _recipe())
    elif defect == "empty":  # a message with none of recipe, header, chunk set
        stream.insert(data.draw(st.integers(0, len(stream))), pb.QuantizeParamsRequest())
    elif defect == "chunk_first":
        stream.insert(1, pb.QuantizeParamsRequest(chunk=pb.TensorChunk(offset=0, data=b"\0")))
    else:
        stream = []
    target.refuse(stream)


@pytest.mark.parametrize(
    ("case", "examples"),
    [
        (_header_defects, 1400),
        (_chunk_defects, 1600),
        (_recipe_defects, 1200),
        (_structure_defects, 800),
    ],
    ids=["header", "chunks", "recipe", "structure"],
)
def test_malformed_streams_get_client_error_codes(target, case, examples):
    before = target.calls
    _settings(examples)(case)(target)
    assert target.calls - before >= examples  # the cases really ran (5,000 over the four)
