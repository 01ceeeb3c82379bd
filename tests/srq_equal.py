"""SRQ results made by a calibration program and by local SRQ, compared.

The program calibrates LiteRT-able rules with the ODML provider, whose ops multiply the
dequantized values in float; local SRQ calibrates with QtProvider, which multiplies the codes and
applies the scales after (as the reference's QT). The same sums rounded in another order: the
statistics of the layers after the first, and the static scales made from them, agree to float32
rounding (measured: 5.6e-7 at most), not bit for bit. Codes, weight scales and kept params come
from the weights alone and are compared bit for bit.
"""

from __future__ import annotations

import numpy as np

STATIC_SCALE_RTOL = 1e-5


def is_static_scale(path: str) -> bool:
    """Whether a PTQ param path is an activation's static scale (`<op>_lhs_scale/...`)."""
    return "_lhs_scale" in path or "_rhs_scale" in path


def assert_srq_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """The same paths and dtypes; static scales within STATIC_SCALE_RTOL, the rest exactly."""
    assert set(got) == set(want)
    for path, value in want.items():
        assert got[path].dtype == value.dtype, path
        if is_static_scale(path):
            np.testing.assert_allclose(got[path], value, STATIC_SCALE_RTOL, err_msg=path)
        else:
            np.testing.assert_array_equal(got[path], value, err_msg=path)
