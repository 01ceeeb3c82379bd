"""Wire messages <-> engine values: the servicer's only proto/engine translation."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from qmill.engine import layout, leaf, recipes
from qmill.proto import recipe, wire
from qmill.proto.v1 import qmill_pb2 as pb


def recipe_from_proto(message: pb.Recipe) -> recipes.Recipe:
    """The engine recipe a Recipe message describes. Raises ValueError naming the bad rule."""
    return recipes.recipe_from_mapping(recipe.to_mapping(message))


def how_to_proto(plan: layout.LeafPlan) -> pb.HowToQuantize:
    return pb.HowToQuantize(
        qtype=plan.qtype or "",
        channelwise_axes=list(plan.channelwise_axes),
        tiled_axes=dict(plan.tiled_axes),
        calibration_method=plan.calibration_method,
    )


def kept_response(plan: layout.LeafPlan, input_bytes: int) -> pb.QuantizeParamsResponse:
    return pb.QuantizeParamsResponse(
        result=pb.TensorResult(
            path=plan.path,
            kind=pb.RESULT_KIND_KEPT,
            reason=plan.reason,
            input_bytes=input_bytes,
        )
    )


def result_responses(
    plan: layout.LeafPlan, result: leaf.LeafResult, input_bytes: int
) -> Iterator[pb.QuantizeParamsResponse]:
    """The TensorResult for a quantized tensor, then the chunks of each of its parts."""
    parts: list[tuple[str, np.ndarray]] = [("qvalue", result.qvalue), ("scale", result.scale)]
    if result.zero_point is not None:
        parts.append(("zero_point", result.zero_point))
    encoded = [(name, array, wire.to_bytes(array)) for name, array in parts]
    yield pb.QuantizeParamsResponse(
        result=pb.TensorResult(
            path=plan.path,
            kind=pb.RESULT_KIND_QUANTIZED,
            how=how_to_proto(plan),
            quality=pb.Quality(
                sqnr_db=result.quality.sqnr_db,
                mean_relative_error=result.quality.mean_relative_error,
            ),
            parts=[wire.header_for(name, array, data) for name, array, data in encoded],
            input_bytes=input_bytes,
        )
    )
    for _, _, data in encoded:
        for chunk in wire.chunks(data):
            yield pb.QuantizeParamsResponse(chunk=chunk)
