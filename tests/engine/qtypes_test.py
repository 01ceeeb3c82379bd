"""qtypes registry: names, storage, bounds, refusals."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from qmill.engine import calibration, qtypes


@pytest.mark.parametrize(
    ("name", "storage", "bound", "asym"),
    [
        ("int8", jnp.int8, 127.5, (-128, 127)),
        ("int4", jnp.int4, 7.5, (-8, 7)),
        ("int2", jnp.int4, 1.5, None),
        ("int3", jnp.int4, 3.5, None),
        ("int5", jnp.int8, 15.5, None),
        ("int7", jnp.int8, 63.5, None),
        ("int16", jnp.int16, 32768.0, (-32768, 32767)),
        ("uint8", jnp.uint8, 255.5, None),
        ("float8_e4m3fn", jnp.float8_e4m3fn, 448.0, None),
        ("float8_e5m2", jnp.float8_e5m2, 57344.0, None),
        ("nf4", jnp.uint4, 1.0, None),
        ("mxfp8", jnp.float8_e4m3fn, 448.0, None),
        ("mxfp4", jnp.float4_e2m1fn, 6.0, None),
        ("nvfp4", jnp.float4_e2m1fn, 6.0, None),
    ],
)
def test_registry_facts(name: str, storage, bound: float, asym) -> None:
    qt = qtypes.get(name)
    assert qt.storage == np.dtype(storage)
    assert qt.bound == bound
    assert qt.asymmetric_range == asym


def test_tile_rules() -> None:
    assert qtypes.get("mxfp8").required_tile == 32
    assert qtypes.get("mxfp8_16").required_tile == 16
    assert qtypes.get("mxfp4").required_tile == 32
    assert qtypes.get("nvfp4").required_tile == 16
    assert qtypes.get("int8").required_tile is None


def test_accepts_dtypes_and_case() -> None:
    assert qtypes.get(jnp.int8).name == "int8"
    assert qtypes.get(np.dtype("int4")).name == "int4"
    assert qtypes.get(jnp.float8_e4m3fn).name == "float8_e4m3fn"
    assert qtypes.get(" NF4 ").name == "nf4"


@pytest.mark.parametrize("bad", ["bfloat16", "float32", jnp.float16, "int9", "fp8", "int1"])
def test_refuses_unsuitable_with_valid_list(bad) -> None:
    with pytest.raises(ValueError, match="valid qtypes: int2, int3"):
        qtypes.get(bad)


def test_names_and_methods_for_capabilities() -> None:
    names = qtypes.names()
    assert {"int8", "int4", "nf4", "mxfp4", "nvfp4", "float8_e5m2", "int16"} <= set(names)
    assert len(names) == len(set(names))
    assert calibration.METHODS == ("absmax", "minmax", "rms", "fixed")


def test_native_matmul_only_for_uniform_narrow_types() -> None:
    assert qtypes.get("int8").native_matmul and qtypes.get("float8_e4m3fn").native_matmul
    assert not qtypes.get("nf4").native_matmul
    assert not qtypes.get("int16").native_matmul  # would overflow int32 accumulation
