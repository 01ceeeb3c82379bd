"""The Calibrator service: a thin adapter over calibrate.Session and the stores.

JAX runs only on the engine executor; the event loop assembles batches and streams answers.
Each batch's bytes are reserved with the server's ByteLimiter before its buffer is allocated and
released once the engine has added it to the statistics, as QuantizeParams does for tensors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from typing import Any

import numpy as np

from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc
from qmill.server import (
    auth,
    calibrate,
    calibrations,
    calls,
    codec,
    errors,
    limits,
    models,
    uploads,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Prepared:
    session: calibrate.Session
    calibration_id: str
    model_key: str
    rules_key: str


class CalibratorServicer(pb_grpc.CalibratorServicer):
    def __init__(
        self,
        executor: futures.Executor,
        uploads_store: uploads.UploadStore,
        calibration_store: calibrations.CalibrationStore,
        *,
        max_tensor_bytes: int,
        resolve: Callable[[pb.ModelSpec], tuple[Any, Any]] = models.resolve,
        limiter: limits.ByteLimiter | None = None,
    ) -> None:
        self._executor = executor
        self._uploads = uploads_store
        self._calibrations = calibration_store
        self._max_tensor_bytes = max_tensor_bytes
        self._resolve = resolve
        # Counts the batches held (None: unlimited).
        self._limiter = limiter

    def _prepare(self, start: pb.CalibrateStart, tenant: str) -> _Prepared:
        entry, config = self._resolve(start.model)
        rules = calibrate.rules_from_proto(start.rules)
        model_key = calibrate.model_key(entry.name, config)
        rules_key = calibrate.rules_key(start.rules)
        previous = None
        if start.calibration_id:
            previous = self._calibrations.load(tenant, start.calibration_id)
            if (previous.model_key, previous.rules_key) != (model_key, rules_key):
                raise wire.WireError(
                    f"calibration {start.calibration_id} was made with another model, config or "
                    "rules; continue it with the same ones, or start a new calibration",
                    code="FAILED_PRECONDITION",
                )
        if not start.params_upload_id:
            raise ValueError("params_upload_id is empty: upload the model's params first")
        params = self._uploads.open_params(tenant, start.params_upload_id)
        session = calibrate.Session(entry, config, params, rules, previous)
        return _Prepared(
            session=session,
            calibration_id=start.calibration_id or calibrations.CalibrationStore.new_id(),
            model_key=model_key,
            rules_key=rules_key,
        )

    def _finish(self, prep: _Prepared, tenant: str, want_ptq: bool) -> tuple[dict, Any]:
        s = prep.session
        stats = s.host_stats()
        self._calibrations.save(
            calibrations.Calibration(
                id=prep.calibration_id,
                tenant=tenant,
                model_key=prep.model_key,
                rules_key=prep.rules_key,
                batches=s.batches,
                examples=s.examples,
                stats=stats,
            )
        )
        ptq = list(calibrate.param_results(s.ptq_params(), s.float_params())) if want_ptq else []
        return stats, ptq

    @errors.streaming
    async def Calibrate(self, request_iterator, context):
        started = time.monotonic()
        tenant = auth.current_principal().tenant
        loop = asyncio.get_running_loop()
        requests = aiter(request_iterator)
        try:
            first = await anext(requests)
        except StopAsyncIteration:
            raise ValueError("empty stream: send CalibrateStart first") from None
        if first.WhichOneof("item") != "start":
            raise ValueError("the first message must be CalibrateStart")
        start = first.start
        prep = await loop.run_in_executor(self._executor, self._prepare, start, tenant)
        new_batches = 0
        account = limits.Account(self._limiter, tenant) if self._limiter else None
        try:
            async for array, nbytes in _batches(requests, self._max_tensor_bytes, account):
                work = loop.run_in_executor(self._executor, prep.session.add_batch, array)
                if account is not None:
                    account.hold_until_done(work)  # the engine reads the bytes until it ends
                await work
                del array
                if account is not None:
                    account.release(nbytes)
                new_batches += 1
                yield pb.CalibrateResponse(
                    progress=pb.CalibrateProgress(
                        batches=prep.session.batches, examples=prep.session.examples
                    )
                )
        finally:
            if account is not None:
                account.close()  # a batch still held (failed, cancelled) goes back now
        if new_batches == 0 and not start.calibration_id:
            raise ValueError("no calibration batches were sent: send at least one")
        stats, ptq = await loop.run_in_executor(
            self._executor, self._finish, prep, tenant, start.return_ptq_params
        )
        for path, array in calibrations.flatten(stats).items():
            data = wire.to_bytes(array)
            yield pb.CalibrateResponse(stat=wire.header_for(path, array, data))
            for chunk in wire.chunks(data):
                yield pb.CalibrateResponse(chunk=chunk)
        for plan, path, result in ptq:
            for response in _param_responses(plan, path, result):
                yield response
        calls.annotate(model=start.model.name, batches=new_batches, calibration=prep.calibration_id)
        yield pb.CalibrateResponse(
            summary=pb.CalibrateSummary(
                calibration_id=prep.calibration_id,
                batches_total=prep.session.batches,
                examples_total=prep.session.examples,
                seconds=time.monotonic() - started,
            )
        )


def _param_responses(plan, path: str, result) -> Iterator[pb.CalibrateResponse]:
    """A PTQ param as QuantizeParams streams it. Float tensors (biases, static activation scales)
    go as RESULT_KIND_FLOAT with one part, 'value', whose bytes follow (the client has no copy)."""
    if plan is not None:
        size = result.qvalue.nbytes  # for reports only, as QuantizeParams' input_bytes
        for r in codec.result_responses(plan, result, size):
            kind = r.WhichOneof("item")
            if kind == "result":
                yield pb.CalibrateResponse(param=r.result)
            else:
                yield pb.CalibrateResponse(chunk=r.chunk)
        return
    array = np.asarray(result)
    data = wire.to_bytes(array)
    yield pb.CalibrateResponse(
        param=pb.TensorResult(
            path=path,
            kind=pb.RESULT_KIND_FLOAT,
            reason="float tensor of the PTQ params (bias or static activation scale)",
            parts=[wire.header_for("value", array, data)],
            input_bytes=len(data),
        )
    )
    for chunk in wire.chunks(data):
        yield pb.CalibrateResponse(chunk=chunk)


async def _batches(
    requests: AsyncIterator[pb.CalibrateRequest], max_bytes: int, account: limits.Account | None
) -> AsyncIterator[tuple[np.ndarray, int]]:
    """(array, bytes reserved) per complete batch; the caller releases the bytes when done."""
    assembler: wire.Assembler | None = None
    async for request in requests:
        kind = request.WhichOneof("item")
        if kind == "batch":
            if assembler is not None:
                assembler.finish()  # DATA_LOSS: the previous batch was cut short
            assembler = await limits.start_assembly(request.batch, max_bytes, account)
        elif kind == "chunk":
            if assembler is None:
                raise ValueError("a chunk arrived before any batch header")
            assembler.add(request.chunk)
        elif kind == "start":
            raise ValueError("CalibrateStart must be sent once, as the first message")
        else:
            raise ValueError("empty request: set one of start, batch or chunk")
        if assembler is not None and assembler.complete:
            nbytes = assembler.header.byte_length if account is not None else 0
            array = assembler.finish()
            assembler = None
            yield array, nbytes
            del array  # counted as released once the caller asks for the next batch
    if assembler is not None:
        assembler.finish()
