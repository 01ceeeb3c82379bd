"""QuantizeParams' static ranges (SRQ on the model-free path): statistics -> PTQ scale params.

The client sends a StaticRanges message right after the recipe, naming a calibration of its own
(Calibrate's id) or carrying the statistics with each one's act qtype. The scales are computed
before any tensor is read (bad statistics fail the call at once) and answered as
RESULT_KIND_FLOAT tensors after the last tensor, before the summary, under the paths a PTQ
model's params use: ``<module>/<op>_<side>_scale/array`` (engine/programs.static_scales).

A calibration made by a method's program (GPTQ and kin) holds per-weight statistics instead;
`method_stats` hands them to the tensor stream, which quantizes those weights with the method
(engine/contrib/leaf.py) as they pass.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np

from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.server import codec, errors
from qmill.server import params as params_lib
from qmill.server.calibrator import store as store_lib

_ONCE = "static_ranges must be sent once, right after the recipe"


async def split(
    requests: AsyncIterator[pb.QuantizeParamsRequest],
) -> tuple[AsyncIterator[pb.QuantizeParamsRequest], pb.StaticRanges | None]:
    """The request stream without its StaticRanges message, and that message (or None)."""
    head: list[pb.QuantizeParamsRequest] = []
    ranges = None
    try:
        head.append(await anext(requests))
        if head[0].WhichOneof("item") == "recipe":
            second = await anext(requests)
            if second.WhichOneof("item") == "static_ranges":
                ranges = second.static_ranges
            else:
                head.append(second)
    except StopAsyncIteration:
        pass

    async def rest() -> AsyncIterator[pb.QuantizeParamsRequest]:
        for request in head:
            yield request
        async for request in requests:
            if request.WhichOneof("item") == "static_ranges":
                raise ValueError(_ONCE)
            yield request

    return rest(), ranges


def _inline_stats(ranges: pb.StaticRanges) -> dict[str, Any]:
    receiver = wire.Receiver()
    flat = {}
    for t in ranges.quant_stats:
        receiver.announce(t.header)
        receiver.add(pb.TensorChunk(offset=0, data=t.data))
        flat.update(receiver.take())
        if receiver.receiving:
            raise ValueError(f"quant_stats {t.header.path}: data is shorter than its header says")
    return params_lib.unflatten(flat)


def scales(
    ranges: pb.StaticRanges, tenant: str, calibrations: store_lib.CalibrationStore | None
) -> dict[str, np.ndarray]:
    """{param path: scale or zero point}; ValueError / NotFound saying what to fix."""
    # Imported here, not with the module: they pull in Flax (~10-18 MB), which a server whose
    # calls send no static ranges never needs (issue 27).
    from qmill.engine.contrib import leaf as contrib_leaf
    from qmill.engine.programs import program as programs

    if ranges.calibration_id and (ranges.quant_stats or ranges.act_qtypes):
        raise ValueError("static_ranges: send a calibration_id or quant_stats, not both")
    if ranges.calibration_id:
        if calibrations is None:
            raise errors.Unimplemented("this server keeps no calibrations")
        cal = calibrations.load(tenant, ranges.calibration_id)
        if not cal.stat_qtypes and not contrib_leaf.method_stats(params_lib.flatten(cal.stats)):
            raise errors.FailedPrecondition(
                f"calibration {ranges.calibration_id} predates static ranges in QuantizeParams; "
                "calibrate again"
            )
        stats, qtypes, aliases = cal.stats, dict(cal.stat_qtypes), dict(cal.stat_aliases)
    else:
        if not ranges.quant_stats:
            raise ValueError("static_ranges: set calibration_id or quant_stats")
        stats, qtypes, aliases = _inline_stats(ranges), dict(ranges.act_qtypes), {}
        for path in {p.rsplit("/", 1)[0] for p in params_lib.flatten(stats)}:
            if path not in qtypes and contrib_leaf.method_of(path) is None:
                raise ValueError(f"static_ranges: act_qtypes has no entry for statistic {path}")
    try:
        return programs.static_scales(stats, qtypes, aliases)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"static_ranges: the statistics are incomplete ({exc})") from None


def method_stats(
    ranges: pb.StaticRanges, tenant: str, calibrations: store_lib.CalibrationStore | None
) -> dict[str, tuple[str, dict[str, np.ndarray]]]:
    """{param path: (method, statistic)} of the calibration's method statistics (may be empty);
    call after `scales`, which checks the message."""
    from qmill.engine.contrib import leaf as contrib_leaf  # Flax: see scales

    if ranges.calibration_id:
        assert calibrations is not None  # scales() refused the call otherwise
        stats = calibrations.load(tenant, ranges.calibration_id).stats
    else:
        stats = _inline_stats(ranges)
    return contrib_leaf.method_stats(params_lib.flatten(stats))


def results(values: dict[str, np.ndarray]) -> Iterator[pb.QuantizeParamsResponse]:
    for path, array in values.items():
        message, chunks = codec.float_result(path, array, reason="static activation scale (SRQ)")
        yield from codec.messages(pb.QuantizeParamsResponse, "result", message, chunks)
