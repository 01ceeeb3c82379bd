"""CalibrateLanguageModel's folded tensors (server/calibrator/servicer.py `_folded`, the client's
`_LmCollector`): one over a chunk, as a Hadamard rotation's embedding is, travels as its header
then its bytes in chunks, every message within the client's limit, and arrives whole."""

from __future__ import annotations

import numpy as np
import pytest

from qmill.cli import lm_server
from qmill.client import client as client_lib
from qmill.client import errors
from qmill.proto import wire
from qmill.server.calibrator import servicer


def _collected(responses) -> list:
    got: list = []
    collector = client_lib._LmCollector(None, got.append)
    for response in responses:
        collector.feed(response)
    return got


def test_a_folded_tensor_over_a_chunk_travels_in_chunks_and_arrives_whole():
    array = np.random.default_rng(0).normal(size=(3, 2**20)).astype(np.float32)  # 12 MiB
    responses = list(servicer._folded("model.embed_tokens.weight", array))
    assert [r.WhichOneof("item") for r in responses] == ["folded"] + ["folded_chunk"] * 4
    assert all(r.ByteSize() <= wire.MAX_CHUNK_BYTES for r in responses)
    (tensor,) = _collected(responses)
    assert tensor.header.path == "model.embed_tokens.weight"
    np.testing.assert_array_equal(lm_server._array(tensor), array)
    small = np.ones(64, np.float32)  # a norm: one message, as before
    (response,) = servicer._folded("model.norm.weight", small)
    np.testing.assert_array_equal(lm_server._array(_collected([response])[0]), small)
    with pytest.raises(errors.QmillError, match="out of order"):
        _collected([responses[0], responses[2]])
