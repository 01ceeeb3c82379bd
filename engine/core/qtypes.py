"""The qtype registry: every logical type a tensor can be quantized to, and its arithmetic facts.

Lingo:
  qtype     the logical type of quantized values ("int4", "nf4", "mxfp4", ...). It may differ from
            the storage dtype of `qvalue` (int3 is stored in int4, nf4 indices in uint4).
  bound     B in `scale = absmax / B` for symmetric calibration (docs/numerics-spec.md, "Bounds").
  range     (qmin, qmax): the values a quantized integer may take; for asymmetric calibration the
            zero point shifts data into this range.
  levels    the real values the stored codes stand for when they are not the codes themselves (nf4).
  tile      blocks of `tile` elements along an axis share one scale (mx / nv formats require one).

One registry answers every question about a qtype, so calibration, conversion, ops and the service's
GetCapabilities can never disagree about what a qtype is.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

# NormalFloat4 levels (QLoRA paper, appendix E), sorted ascending; index = stored code.
NF4_LEVELS: tuple[float, ...] = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)

# Kinds of qtype: how a real value becomes a stored code.
INT = "int"  # round half to even, saturate to range
FLOAT = "float"  # clip to ±max, cast (round to nearest even)
LOOKUP = "lookup"  # index of the nearest level (nf4)

# How a computed scale is snapped before use (mx / nv formats).
POW2 = "pow2"  # rounded up to a power of two (numerics._snap_pow2)
E4M3 = "e4m3"  # round through float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class QType:
    """Everything the engine needs to know about one logical qtype."""

    # Canonical name, e.g. "int8", "float8_e4m3fn", "nf4".
    name: str
    # How values are converted: INT, FLOAT or LOOKUP.
    kind: str
    # dtype of the stored qvalue (may be wider than the logical type).
    storage: np.dtype
    # Logical bits per value.
    bits: int
    # Symmetric bound B: scale = absmax / B.
    bound: float
    # Smallest and largest stored value (codes for LOOKUP, ±finfo.max for FLOAT).
    qmin: float
    qmax: float
    # (qmin, qmax) for asymmetric calibration; None when the qtype refuses it.
    asymmetric_range: tuple[int, int] | None = None
    # Real value of each code for LOOKUP qtypes.
    levels: tuple[float, ...] | None = None
    # Tile size this qtype requires on its tiled axis (mx / nv formats); None = any tiling.
    required_tile: int | None = None
    # POW2, E4M3 or None: how the scale is snapped to what the format can store.
    scale_rounding: str | None = None
    # Whether ops may multiply stored values directly and apply scales to the output.
    native_matmul: bool = False

    @property
    def is_integer(self) -> bool:
        return self.kind == INT

    @property
    def accumulator(self) -> np.dtype:
        """dtype a native matmul of two values of this qtype accumulates in."""
        return np.dtype(np.int32) if self.kind == INT else np.dtype(np.float32)


def _int(name: str, bits: int, storage: Any, *, bound: float | None = None) -> QType:
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return QType(
        name=name,
        kind=INT,
        storage=np.dtype(storage),
        bits=bits,
        # Half a step past qmax: the top bucket is used fully.
        bound=bound if bound is not None else qmax + 0.5,
        qmin=qmin,
        qmax=qmax,
        # Asymmetric calibration only where the logical type is a real storage type.
        asymmetric_range=(qmin, qmax) if bits in (4, 8, 16) else None,
        # int16 products overflow an int32 accumulator after a few terms: dequantize instead.
        native_matmul=bits <= 8,
    )


def _uint(name: str, bits: int, storage: Any) -> QType:
    qmax = 2**bits - 1
    # Unsigned qtypes are symmetric only: negative values saturate at 0 (reference behaviour).
    return QType(
        name=name,
        kind=INT,
        storage=np.dtype(storage),
        bits=bits,
        bound=qmax + 0.5,
        qmin=0,
        qmax=qmax,
        native_matmul=False,
    )


def _float(name: str, dtype: Any, **kw: Any) -> QType:
    fmax = float(ml_dtypes.finfo(dtype).max)
    return QType(
        name=name,
        kind=FLOAT,
        storage=np.dtype(dtype),
        bits=4 if np.dtype(dtype) == np.dtype(ml_dtypes.float4_e2m1fn) else 8,
        bound=fmax,
        qmin=-fmax,
        qmax=fmax,
        **kw,
    )


_FP8_NAMES = (
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3b11fnuz",
    "float8_e4m3",
    "float8_e3m4",
)


def _build() -> dict[str, QType]:
    table: dict[str, QType] = {}
    for bits in range(2, 8):
        storage = jnp.int4 if bits <= 4 else jnp.int8
        table[f"int{bits}"] = _int(f"int{bits}", bits, storage)
    table["int8"] = _int("int8", 8, jnp.int8)
    # docs/numerics-spec.md fixes the int16 bound at 32768 (not 32767.5).
    table["int16"] = _int("int16", 16, jnp.int16, bound=32768.0)
    table["uint4"] = _uint("uint4", 4, jnp.uint4)
    table["uint8"] = _uint("uint8", 8, jnp.uint8)
    for name in _FP8_NAMES:
        table[name] = _float(name, getattr(jnp, name), native_matmul=True)
    table["float4_e2m1fn"] = _float("float4_e2m1fn", jnp.float4_e2m1fn)
    table["nf4"] = QType(
        name="nf4",
        kind=LOOKUP,
        storage=np.dtype(jnp.uint4),
        bits=4,
        bound=1.0,
        qmin=0,
        qmax=15,
        levels=NF4_LEVELS,
    )
    e4m3 = jnp.float8_e4m3fn
    table["mxfp8"] = _float("mxfp8", e4m3, required_tile=32, scale_rounding=POW2)
    table["mxfp8_16"] = _float("mxfp8_16", e4m3, required_tile=16, scale_rounding=POW2)
    e2m1 = jnp.float4_e2m1fn
    table["mxfp4"] = _float("mxfp4", e2m1, required_tile=32, scale_rounding=POW2)
    table["nvfp4"] = _float("nvfp4", e2m1, required_tile=16, scale_rounding=E4M3)
    return table


_REGISTRY: dict[str, QType] = _build()


def names() -> tuple[str, ...]:
    """All valid qtype names, in registry order (for GetCapabilities and error messages)."""
    return tuple(_REGISTRY)


class QTypeName(str):
    """A canonical qtype name that also equals the other forms of that qtype.

    The reference stores dtypes (``jnp.int8``) where they exist, so user code compares
    ``qarray.qtype == jnp.int8``; a plain ``"int8"`` would compare unequal. Equality with a
    string is string equality; with a dtype or scalar type it compares canonical names. The hash
    is the string's, so it stays a valid static (jit) field and dict key.
    """

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return str.__eq__(self, other)
        if other is None or isinstance(other, int | float):
            return False
        try:
            return str.__eq__(self, _get_by_name(_name_of(other)).name)
        except ValueError:
            return False

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = str.__hash__

    def __reduce__(self) -> tuple:
        return (QTypeName, (str(self),))


def _name_of(qtype: Any) -> str:
    if isinstance(qtype, str):
        return qtype.strip().lower()
    try:
        return np.dtype(qtype).name
    except TypeError:
        return repr(qtype)


@functools.cache
def _get_by_name(name: str) -> QType:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"{name!r} is not a qtype the engine can quantize to; valid qtypes: "
            f"{', '.join(_REGISTRY)}"
        ) from None


def get(qtype: QType | str | Any) -> QType:
    """The QType record for a name, a jnp/numpy dtype or a QType.

    Raises:
      ValueError: unknown or unsuitable qtype (e.g. "bfloat16"); the message lists valid names.
    """
    if isinstance(qtype, QType):
        return qtype
    return _get_by_name(_name_of(qtype))


def name(qtype: QType | str | Any) -> str:
    """Canonical name of a qtype given in any accepted form (a QTypeName: equals jnp.int8 too)."""
    return QTypeName(get(qtype).name)
