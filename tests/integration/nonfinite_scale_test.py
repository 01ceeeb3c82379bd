"""On the service path a non-finite scale is INVALID_ARGUMENT with the fix, never a result
(issue 18, item 4). Real server on 127.0.0.1."""

from __future__ import annotations

import numpy as np
import pytest

from qmill.client import Client, errors

F16_SCALES = {"rules": [{"qtype": "int8", "scale_dtype": "float16"}]}


def test_a_scale_float16_cannot_hold_is_refused_and_the_server_keeps_serving(server):
    big = np.full((16, 8), 1e7, np.float32)  # absmax/127 = 78,740 > float16's 65,504
    with Client(server.address, timeout=60) as client:
        with pytest.raises(errors.QmillError) as e:
            list(client.quantize(F16_SCALES, [("w/kernel", big)]))
        assert e.value.code == "INVALID_ARGUMENT"
        assert "w/kernel: quantizing gave 8 of 8 scales that are not finite" in e.value.details
        assert "use float32" in e.value.details
        (fine,) = client.quantize(F16_SCALES, [("w/kernel", big / 1e4)])
    assert fine.quantized and np.isfinite(fine.parts["scale"].astype(np.float32)).all()
