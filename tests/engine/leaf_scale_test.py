"""A scale that is not finite and positive is an error, never an output (issue 18, item 4): a
finite tensor whose scales overflow or underflow their scale_dtype wrote inf or 0 scales and
garbage codes (or failed with "math domain error")."""

from __future__ import annotations

import numpy as np
import pytest

from qmill.engine.modelfree import layout, leaf


def _plan(scale_dtype: str | None, qtype: str = "int8") -> layout.LeafPlan:
    return layout.LeafPlan(path="w", qtype=qtype, channelwise_axes=(1,), scale_dtype=scale_dtype)


@pytest.mark.parametrize(
    ("value", "found"),
    [(1e7, "inf"), (1e-9, "0.0")],  # 1e7/127 overflows float16; 1e-9/127 flushes to 0
)
def test_scales_that_do_not_fit_their_dtype_are_refused(value, found):
    x = np.full((8, 4), value, np.float32)
    with pytest.raises(ValueError) as e:
        leaf.quantize_leaf(x, _plan("float16"))
    assert str(e.value) == (
        f"w: quantizing gave 4 of 4 scales that are not finite and positive (e.g. {found}); "
        "scale_dtype float16 cannot hold this tensor's scales: use float32"
    )


def test_the_same_tensors_quantize_with_float32_scales():
    for value in (1e7, 1e-9):
        result = leaf.quantize_leaf(np.full((8, 4), value, np.float32), _plan("float32"))
        assert np.isfinite(result.scale).all() and (result.scale > 0).all()
        assert (result.qvalue == 127).all()


def test_an_all_zero_tensor_still_gets_unit_scales():
    result = leaf.quantize_leaf(np.zeros((8, 4), np.float32), _plan("float16"))
    assert (result.scale == 1).all() and (result.qvalue == 0).all()
