"""compressed-tensors' tensor layout: a quantized Linear weight as compressed-tensors stores it.

For a weight `M.weight` of shape (out, in), the engine's parts (qvalue, scale, zero_point, in the
PyTorch layout) become, as compressed-tensors 0.19 writes them:

- pack-quantized (int4/int8 groups): `M.weight_packed` int32 (out, ceil(in * bits / 32)): the
  codes offset to unsigned (code + 2^(bits-1)) and packed densely, code i at bit i * bits of
  the row (little-endian words); `M.weight_scale` (out, groups) in the weight's dtype;
  `M.weight_shape` int64 [out, in]; asymmetric: `M.weight_zero_point` int32, the zero points
  packed the same way along the output axis ((ceil(out * bits / 32), groups)).
- mxfp4- / nvfp4-pack-quantized: `M.weight_packed` uint8 (out, in / 2), fp4 codes two a byte,
  low nibble first; `M.weight_scale` uint8 E8M0 exponents (mx) or float8_e4m3fn (nv); nv adds
  `M.weight_global_scale` float32 [1], which divides the scale (ct_global).
- int-quantized / float-quantized: `M.weight` int8 or float8_e4m3fn as it is (codes of fewer
  bits, W4A8's int4, one per int8), `M.weight_scale` (out, 1) per channel, (out, in/128) per
  group, (ceil(out/128), ceil(in/128)) per block, or [1] per tensor (FP8).
- mxfp8-quantized: `M.weight` float8_e4m3fn as it is, `M.weight_scale` uint8 E8M0 (out, in/32).
- A static-activation scheme adds the Linear's calibrated input scale, `M.input_scale` [1] in
  the weight's dtype (FP8) or `M.input_global_scale` float32 [1] (NVFP4): parts of those names
  (ct_activations) stored as they are.

`decompress` is the inverse, back to the engine's parts, so a compressed-tensors folder (ours or
llm-compressor's) loads into the Qwix PTQ tree.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np

from qmill.checkpoints import ct_schemes, dtypes

# The suffixes compressed-tensors adds to a module name, by part.
PACKED, SCALE, SHAPE = "weight_packed", "weight_scale", "weight_shape"
ZERO_POINT = "weight_zero_point"
GLOBAL_SCALE = "weight_global_scale"
# A Linear's calibrated input scales (static-activation schemes), stored under these names.
INPUT_PARTS = ("input_scale", "input_global_scale")
MXFP4 = "mxfp4-pack-quantized"
MX_FORMATS = (MXFP4, ct_schemes.MXFP8)
NVFP4 = ct_schemes.NVFP4
FP4_FORMATS = (MXFP4, NVFP4)
_WEIGHT = ".weight"


def module_of(path: str) -> str:
    """`M` of a weight path `M.weight`."""
    if not path.endswith(_WEIGHT):
        raise ValueError(f"{path}: compressed-tensors quantizes `<module>.weight` tensors only")
    return path[: -len(_WEIGHT)]


def pack_int32(codes: np.ndarray, bits: int) -> np.ndarray:
    """Signed `bits`-bit codes (rows, cols) -> int32 (rows, ceil(cols * bits / 32)), densely."""
    rows, cols = np.shape(codes)
    per = 32 // bits
    if bits in (4, 8) and cols % per == 0:
        # Byte-wise (the common case, ~10x faster): code + 2^(bits-1) is the code's byte with
        # its sign bit flipped (int4 codes may be stored sign-extended: masked to the nibble).
        raw = np.ascontiguousarray(codes).view(np.uint8)
        if bits == 8:
            return (raw ^ np.uint8(0x80)).view("<i4")
        unsigned = (raw + np.uint8(8)) & np.uint8(0x0F)
        return np.ascontiguousarray(unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)).view("<i4")
    if 32 % bits == 0 and cols % per == 0:
        # Whole words (4- and 8-bit codes, as Linear shapes have): shift and or in uint32.
        unsigned = (np.asarray(codes).astype(np.int32) + (1 << (bits - 1))).astype(np.uint32)
        unsigned = unsigned.reshape(rows, cols // per, per)
        words = unsigned[:, :, 0].copy()
        for i in range(1, per):
            words |= unsigned[:, :, i] << np.uint32(i * bits)
        return words.view(np.int32)
    codes = np.asarray(codes).astype(np.int64) + (1 << (bits - 1))
    words = -(-cols * bits // 32)
    padded = -(-cols // 32) * 32  # whole runs of 32 codes: bits words each
    value = np.zeros((rows, padded), np.uint64)
    value[:, :cols] = codes
    value = value.reshape(rows, padded // 32, 32)
    out = np.zeros((rows, padded // 32, bits), np.uint64)
    for i in range(32):  # code i of a run starts at bit i*bits of the run's bits words
        word, shift = divmod(i * bits, 32)
        out[:, :, word] |= (value[:, :, i] << np.uint64(shift)) & np.uint64(0xFFFFFFFF)
        spill = shift + bits - 32
        if spill > 0:
            out[:, :, word + 1] |= value[:, :, i] >> np.uint64(bits - spill)
    flat = out.reshape(rows, -1)[:, :words].astype(np.uint32)
    return flat.view(np.int32)


def unpack_int32(packed: np.ndarray, bits: int, cols: int) -> np.ndarray:
    """The inverse of pack_int32: int32 words -> signed codes (rows, cols) as int8."""
    words = np.asarray(packed).view(np.uint32).astype(np.uint64)
    rows = words.shape[0]
    need = -(-cols // 32) * bits
    full = np.zeros((rows, need), np.uint64)
    full[:, : min(need, words.shape[1])] = words[:, :need]
    runs = full.reshape(rows, -1, bits)
    mask = np.uint64((1 << bits) - 1)
    codes = np.zeros((rows, runs.shape[1], 32), np.uint64)
    for i in range(32):
        word, shift = divmod(i * bits, 32)
        value = runs[:, :, word] >> np.uint64(shift)
        spill = shift + bits - 32
        if spill > 0:
            value |= runs[:, :, word + 1] << np.uint64(bits - spill)
        codes[:, :, i] = value & mask
    codes = codes.reshape(rows, -1)[:, :cols].astype(np.int16) - (1 << (bits - 1))
    return codes.astype(np.int8)


def pack_fp4(codes: np.ndarray) -> np.ndarray:
    """float4_e2m1fn (rows, cols) -> uint8 (rows, cols / 2), code 2i in the low nibble."""
    nibbles = np.asarray(codes).view(np.uint8) & 0xF
    return (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).astype(np.uint8)


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    rows, half = packed.shape
    nibbles = np.empty((rows, half * 2), np.uint8)
    nibbles[:, 0::2] = packed & 0xF
    nibbles[:, 1::2] = packed >> 4
    return nibbles.view(ml_dtypes.float4_e2m1fn)


def e8m0(scale: np.ndarray) -> np.ndarray:
    """Power-of-two scales -> their biased exponents (E8M0, uint8), as compressed-tensors stores
    MX scales."""
    _, exponent = np.frexp(np.asarray(scale).astype(np.float64))
    return (exponent - 1 + 127).clip(0, 255).astype(np.uint8)


def from_e8m0(biased: np.ndarray) -> np.ndarray:
    return np.ldexp(np.float32(1), np.asarray(biased).astype(np.int32) - 127).astype(np.float32)


def compress(
    scheme: ct_schemes.Scheme,
    path: str,
    parts: dict[str, np.ndarray | dtypes.Packed4],
    global_scale: float | None = None,
    scratch: Callable[[int], np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """The tensors compressed-tensors stores for weight `path` quantized as `parts` (NVFP4:
    with the `global_scale` it was quantized with).

    `scratch(n)`, when given, lends n bytes the int4 words may be made in, valid until the next
    call: a writer that stores the words at once reuses one buffer instead of faulting in a
    fresh one per weight (the page faults cost ~20x the XOR itself)."""
    module = module_of(path)
    inputs = {f"{module}.{k}": np.asarray(parts[k]) for k in INPUT_PARTS if k in parts}
    return inputs | _weight(scheme, path, parts, global_scale, scratch)


def _weight(
    scheme: ct_schemes.Scheme,
    path: str,
    parts: dict[str, np.ndarray | dtypes.Packed4],
    global_scale: float | None,
    scratch: Callable[[int], np.ndarray] | None,
) -> dict[str, np.ndarray]:
    module = module_of(path)
    qvalue = parts["qvalue"]
    scale = np.asarray(parts["scale"])
    zero_point = parts.get("zero_point")
    if len(qvalue.shape) != 2:
        raise ValueError(f"{path}: compressed-tensors stores 2-D weights, got {qvalue.shape}")
    rows, cols = qvalue.shape
    # 4-bit codes the engine packed (two a byte, low nibble first) are already compressed-
    # tensors' order: fp4 bytes as they are; int4 bytes with each nibble offset by 8 (bit 3
    # flipped) are its int32 words' bytes.
    packed = qvalue.packed if isinstance(qvalue, dtypes.Packed4) else None
    if scheme.format in FP4_FORMATS:
        if packed is not None and cols % 2 == 0:
            codes = packed.reshape(rows, cols // 2)
        else:
            codes = pack_fp4(np.asarray(qvalue))
        if scheme.format == MXFP4:
            return {f"{module}.{PACKED}": codes, f"{module}.{SCALE}": e8m0(scale)}
        if global_scale is None:
            raise ValueError(f"{path}: an NVFP4 weight needs its global scale")
        return {
            f"{module}.{GLOBAL_SCALE}": np.asarray([global_scale], np.float32),
            f"{module}.{PACKED}": codes,
            f"{module}.{SCALE}": scale,
        }
    if scheme.format == ct_schemes.MXFP8:
        return {f"{module}.weight": np.asarray(qvalue), f"{module}.{SCALE}": e8m0(scale)}
    if scheme.format != "pack-quantized":
        codes = np.asarray(qvalue)
        if scheme.weights["type"] == "int" and codes.dtype != np.int8:
            codes = codes.astype(np.int8)  # int2..int4 codes: one per int8, as torch holds them
        if scheme.weights.get("strategy") == "tensor":
            scale = scale.reshape(1)  # one per tensor: compressed-tensors' shape [1]
        return {f"{module}.weight": codes, f"{module}.{SCALE}": scale}
    bits = scheme.num_bits
    if packed is not None and bits == 4 and cols % 8 == 0:
        flipped = scratch(packed.size) if scratch is not None else np.empty_like(packed)
        np.bitwise_xor(packed, np.uint8(0x88), out=flipped)
        words = flipped.view("<i4").reshape(rows, cols // 8)
    else:
        words = pack_int32(np.asarray(qvalue), bits)
    out = {
        f"{module}.{PACKED}": words,
        f"{module}.{SCALE}": scale,
        f"{module}.{SHAPE}": np.asarray((rows, cols), np.int64),
    }
    if zero_point is not None:
        # Packed along the output axis (compressed-tensors' packed_dim=0).
        out[f"{module}.{ZERO_POINT}"] = pack_int32(np.asarray(zero_point).T, bits).T.copy()
    return out


def decompress(
    scheme: ct_schemes.Scheme, module: str, stored: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The engine's parts (qvalue, scale[, zero_point]) of `module`'s stored tensors."""
    scale = np.asarray(stored[f"{module}.{SCALE}"])
    if scheme.format == MXFP4:
        packed = np.asarray(stored[f"{module}.{PACKED}"])
        return {"qvalue": unpack_fp4(packed), "scale": from_e8m0(scale)}
    if scheme.format == ct_schemes.MXFP8:
        return {"qvalue": np.asarray(stored[f"{module}.weight"]), "scale": from_e8m0(scale)}
    if scheme.format == NVFP4:
        # The value of a code is code · scale / global scale (float32), as compressed-tensors
        # decompresses it: the Qwix scale is that quotient.
        packed = np.asarray(stored[f"{module}.{PACKED}"])
        glob = np.asarray(stored[f"{module}.{GLOBAL_SCALE}"], np.float32).reshape(())
        return {"qvalue": unpack_fp4(packed), "scale": scale.astype(np.float32) / glob}
    if scheme.format != "pack-quantized":
        codes = np.asarray(stored[f"{module}.weight"])
        if codes.dtype == np.int8 and scheme.num_bits <= 4:
            codes = codes.astype(ml_dtypes.int4)  # the logical type the engine stores them in
        # The Qwix scale has the weight's rank: a per-tensor [1] is (1, 1).
        return {"qvalue": codes, "scale": scale.reshape(1, 1) if scale.ndim == 1 else scale}
    bits = scheme.num_bits
    out_features, in_features = (int(n) for n in np.asarray(stored[f"{module}.{SHAPE}"]))
    codes = unpack_int32(stored[f"{module}.{PACKED}"], bits, in_features)
    logical = ml_dtypes.int4 if bits <= 4 else np.int8
    parts = {"qvalue": codes.astype(logical), "scale": scale}
    zp = stored.get(f"{module}.{ZERO_POINT}")
    if zp is not None:
        zero_point = unpack_int32(np.asarray(zp).T.copy(), bits, out_features).T
        parts["zero_point"] = zero_point.astype(logical)
    return parts
