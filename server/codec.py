"""Wire messages <-> engine values: the server's only proto/engine translation.

Requests become engine values here (recipes, model rules, input specs) and engine results become
TensorResults whose parts travel through the one tensor sender of proto/wire.py. Servicers wrap
what this returns in their RPC's own messages (`messages`).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import jax
import numpy as np

from qmill.checkpoints.base import dtypes as checkpoint_dtypes
from qmill.checkpoints.lm import calibration as lm_calibration
from qmill.engine.core import qtypes
from qmill.engine.modelfree import layout, leaf, recipes
from qmill.engine.modeling import rules as rules_lib
from qmill.proto import framing, recipe, wire
from qmill.proto.v1 import qmill_pb2 as pb

M = TypeVar("M")
# The reason a float tensor of Calibrate's PTQ params gives (the client has no copy of it).
FLOAT_PARAM_REASON = "float tensor of the PTQ params (bias or static activation scale)"


async def first_item(requests: AsyncIterator[Any], field: str, name: str) -> Any:
    """The `field` of a request stream's first message, which must set it (`name` says what it
    is in the messages: "the recipe", "CalibrateStart")."""
    try:
        first = await anext(requests)
    except StopAsyncIteration:
        raise ValueError(f"empty stream: send {name} first") from None
    if first.WhichOneof("item") != field:
        raise ValueError(f"the first message must be {name}")
    return getattr(first, field)


def recipe_from_proto(message: pb.Recipe) -> recipes.Recipe:
    """The engine recipe a Recipe message describes. Raises ValueError naming the bad rule."""
    return recipes.recipe_from_mapping(recipe.to_mapping(message))


def rules_from_proto(messages: Sequence[pb.ModelRule]) -> list[rules_lib.QuantizationRule]:
    """ModelRule messages -> engine rules (ValueError with the rule's index when one is bad)."""
    out = []
    for i, r in enumerate(messages):
        try:
            for qtype in (r.weight_qtype, r.act_qtype):
                if qtype:
                    qtypes.name(qtype)
            out.append(
                rules_lib.QuantizationRule(
                    module_path=r.module_path or ".*",
                    op_names=tuple(r.op_names),
                    weight_qtype=r.weight_qtype or None,
                    act_qtype=r.act_qtype or None,
                    tile_size=r.tile_size or None,
                    weight_calibration_method=r.weight_calibration_method or "absmax",
                    act_calibration_method=r.act_calibration_method or None,
                    act_static_scale=r.act_static_scale or None,
                    act_batch_axes=tuple(r.act_batch_axes) or (0,),
                )
            )
        except (ValueError, TypeError) as exc:
            raise ValueError(f"rules[{i}]: {exc}") from exc
    return out


def input_spec(shape: Sequence[int], dtype: int) -> jax.ShapeDtypeStruct:
    """A model input's shape (batch first) and wire dtype (F32 when unset) as jax describes it."""
    dims = tuple(int(d) for d in shape)
    if not dims or any(d <= 0 for d in dims):
        raise ValueError(f"input_shape must be positive dimensions, batch first; got {list(dims)}")
    return jax.ShapeDtypeStruct(dims, wire.to_numpy_dtype(dtype or pb.DTYPE_F32))


def how_to_proto(plan: layout.LeafPlan) -> pb.HowToQuantize:
    return pb.HowToQuantize(
        qtype=plan.qtype or "",
        channelwise_axes=list(plan.channelwise_axes),
        tiled_axes=dict(plan.tiled_axes),
        calibration_method=plan.calibration_method,
    )


def quality_to_proto(quality: leaf.Quality) -> pb.Quality:
    return pb.Quality(sqnr_db=quality.sqnr_db, mean_relative_error=quality.mean_relative_error)


def kept_result(plan: layout.LeafPlan, input_bytes: int) -> pb.TensorResult:
    """A tensor the plan keeps as it is: no parts (the client writes its own copy)."""
    return pb.TensorResult(
        path=plan.path, kind=pb.RESULT_KIND_KEPT, reason=plan.reason, input_bytes=input_bytes
    )


def quantized_result(
    plan: layout.LeafPlan, result: leaf.LeafResult, input_bytes: int
) -> tuple[pb.TensorResult, Iterator[pb.TensorChunk]]:
    """The TensorResult of a quantized tensor and the chunks of its parts, in part order."""
    message, data = quantized_parts(plan, result, input_bytes)
    return message, (chunk for piece in data for chunk in wire.chunks(piece))


def quantized_parts(
    plan: layout.LeafPlan, result: leaf.LeafResult, input_bytes: int
) -> tuple[pb.TensorResult, list[np.ndarray]]:
    """The TensorResult of a quantized tensor and the bytes of its parts, in part order (for
    encoded_messages)."""
    qvalue = result.qvalue
    if result.packed_as is not None:  # 4-bit codes the engine packed as the wire carries them
        qvalue = checkpoint_dtypes.Packed4(qvalue, *result.packed_as)
    parts = {"qvalue": qvalue, "scale": result.scale}
    if result.zero_point is not None:
        parts["zero_point"] = result.zero_point
    parts.update(result.beside)  # AWQ's awq_scale, SmoothQuant's inv_sq_scale (P/<name>)
    headers, data = wire.part_bytes(parts)
    message = pb.TensorResult(
        path=plan.path,
        kind=pb.RESULT_KIND_QUANTIZED,
        how=how_to_proto(plan),
        quality=quality_to_proto(result.quality),
        parts=headers,
        input_bytes=input_bytes,
    )
    return message, data


def float_result(
    path: str, array: np.ndarray, reason: str = FLOAT_PARAM_REASON
) -> tuple[pb.TensorResult, Iterator[pb.TensorChunk]]:
    """A float tensor sent back whole: one part, 'value', whose bytes follow."""
    headers, chunks = wire.encode_parts({"value": array})
    message = pb.TensorResult(
        path=path,
        kind=pb.RESULT_KIND_FLOAT,
        reason=reason,
        parts=headers,
        input_bytes=headers[0].byte_length,
    )
    return message, chunks


def messages(
    message: Callable[..., M],
    field: str,
    result: pb.TensorResult,
    chunks: Iterable[pb.TensorChunk] = (),
) -> Iterator[M]:
    """A TensorResult then its chunks, each in the RPC's own message (as wire.send does for one
    tensor): `message(**{field: result})`, then `message(chunk=chunk)`."""
    yield message(**{field: result})
    for chunk in chunks:
        yield message(chunk=chunk)


def encoded_messages(
    message: type, field: str, result: pb.TensorResult, data: Iterable[np.ndarray]
) -> Iterator[Any]:
    """messages(message, field, result, chunks of `data`) with the chunks as serialized
    `message(chunk=...)` (framing.encoded_chunks: one copy of their bytes instead of four), for a
    stream whose serializer passes bytes through (framing.serialized)."""
    yield message(**{field: result})
    for piece in data:
        yield from framing.encoded_chunks(message, piece)


def odml_info(tflite: bytes, ops: Sequence[str], quantized_weights: Any) -> pb.OdmlModelInfo:
    """What an exported .tflite holds, as ExportOdml announces it before its bytes."""
    return pb.OdmlModelInfo(
        byte_length=len(tflite),
        crc32c=wire.crc32c(tflite),
        ops=list(ops),
        quantized_weights=dict(quantized_weights),
    )


def byte_chunks(data: bytes) -> Iterator[pb.TensorChunk]:
    """Opaque bytes (an exported model) in the same chunks as a tensor's."""
    return wire.chunks(np.frombuffer(data, np.uint8))


def inline_tensor(path: str, array: np.ndarray) -> pb.InlineTensor:
    """A small tensor inside a message, as its header and wire bytes."""
    data = wire.to_bytes(array)
    return pb.InlineTensor(header=wire.header_for(path, array, data), data=data.tobytes())


def token_ids(message: pb.InlineTensor, what: str) -> np.ndarray:
    """An InlineTensor of token ids as an int32 (samples, tokens) array (`what`: the field's
    name, for the message). Raises ValueError saying what to fix."""
    header = message.header
    if header.dtype != pb.DTYPE_INT32:
        raise ValueError(f"{what} must be DTYPE_INT32 token ids, got {pb.DType.Name(header.dtype)}")
    shape = tuple(int(d) for d in header.shape)
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 2:
        raise ValueError(
            f"{what} must be (samples, tokens) with at least one sample of 2 tokens, got shape "
            f"{list(shape)}"
        )
    if header.crc32c != wire.crc32c(message.data):
        raise wire.WireError(f"{what}: crc32c mismatch; send the ids again", "DATA_LOSS")
    try:
        return wire.from_bytes(message.data, header.dtype, shape).astype(np.int32)
    except wire.WireError as e:
        raise ValueError(f"{what}: {e}") from None


def lm_options(
    message: pb.LanguageModelCalibration,
) -> tuple[lm_calibration.LmRequest, float | None]:
    """The calibration a language-model job asks for, as lm_calibration.LmRequest, and its
    perplexity gate (percent, or None). Raises ValueError saying what to fix."""
    if message.method not in lm_calibration.METHODS:
        raise ValueError(
            f"language_model.method {message.method!r} is not one of: "
            + ", ".join(lm_calibration.METHODS)
        )
    if not message.HasField("calibration_ids"):
        raise ValueError("language_model.calibration_ids is unset: send the calibration tokens")
    calibration = token_ids(message.calibration_ids, "language_model.calibration_ids")
    evaluation = None
    if message.HasField("eval_ids"):
        evaluation = token_ids(message.eval_ids, "language_model.eval_ids")
    if message.gptq_block_size < 0:
        raise ValueError(f"gptq_block_size must be positive, got {message.gptq_block_size}")
    dampening = message.gptq_dampening if message.HasField("gptq_dampening") else 0.01
    if not math.isfinite(dampening) or dampening < 0:
        raise ValueError(f"gptq_dampening must be a fraction >= 0, got {dampening}")
    if message.gptq_actorder not in ("", "static", "none"):
        raise ValueError(f"gptq_actorder {message.gptq_actorder!r} is not static or none")
    gate = None
    if message.HasField("max_ppl_increase"):
        gate = message.max_ppl_increase
        if math.isnan(gate):
            raise ValueError("max_ppl_increase is NaN: give a percentage")
        if evaluation is None:
            raise ValueError("max_ppl_increase needs eval_ids (the held-out tokens)")
    alpha = message.smoothquant_alpha if message.HasField("smoothquant_alpha") else 0.5
    if message.awq_grid < 0:
        raise ValueError(f"awq_grid must be at least 2, got {message.awq_grid}")
    if message.awq_no_clip and message.method != "awq":
        raise ValueError(
            f"awq_no_clip turns off --method awq's weight clipping; method {message.method!r} "
            "clips nothing: leave it false"
        )
    correction = 0.5
    if message.HasField("qep_correction"):
        if message.method != "qep":
            raise ValueError(
                f"qep_correction is method qep's; method {message.method!r} corrects nothing: "
                "leave it unset"
            )
        correction = message.qep_correction
        if not 0.0 <= correction <= 1.0:  # NaN too
            raise ValueError(f"qep_correction must be in [0, 1], got {correction}")
    seed = 0
    if message.HasField("hadamard_seed"):
        if message.method not in ("hadamard", "hadamard+gptq"):
            raise ValueError(
                f"hadamard_seed is methods hadamard's and hadamard+gptq's; method "
                f"{message.method!r} rotates nothing: leave it unset"
            )
        seed = message.hadamard_seed
    request = lm_calibration.LmRequest(
        calibration_ids=calibration,
        eval_ids=evaluation,
        blocksize=message.gptq_block_size or 128,
        percdamp=dampening,
        actorder=message.gptq_actorder != "none",
        method=message.method,
        smoothquant_alpha=alpha,
        awq_grid=message.awq_grid or 20,
        awq_clip=not message.awq_no_clip,
        qep_correction=correction,
        hadamard_seed=seed,
        all_experts=message.calibrate_all_experts,
    )
    return request, gate
