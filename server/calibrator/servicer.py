"""The Calibrator service: a thin adapter over session.Session and the stores.

JAX runs only on the engine executor; the event loop assembles batches and streams answers.
Each batch's bytes are reserved with the server's ByteLimiter before its buffer is allocated and
released once the engine has added it to the statistics, as QuantizeParams does for tensors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent import futures
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from qmill.proto import wire
from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc
from qmill.server import auth, calls, codec, errors, limits, params, registry
from qmill.server.calibrator import expiry, language_model
from qmill.server.calibrator import store as store_lib
from qmill.server.uploads import store as uploads_lib

if TYPE_CHECKING:
    # Imported on use in the methods below: they pull in Flax and the engine's providers
    # (~10-18 MB of memory), which a server that only quantizes never needs (issue 27).
    from qmill.server.calibrator import program_session
    from qmill.server.calibrator import session as session_lib

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Prepared:
    session: session_lib.Session | program_session.ProgramSession
    calibration_id: str
    model_key: str
    rules_key: str


def sweep_expired(
    calibrations: store_lib.CalibrationStore, language_models: language_model.LmCalibrations
) -> int:
    """Removes the calibrations of both kinds unused for longer than the server's expiry (the
    server at start, each calibrate call); returns how many, and logs it."""
    removed = calibrations.sweep() + language_models.sweep()
    if removed:
        log.info(
            "removed %d calibration(s) unused for %s (--calibration-expiry-seconds)",
            removed,
            expiry.describe(calibrations.expiry.seconds),
        )
    return removed


def rules_key(messages: Sequence[pb.ModelRule]) -> str:
    """A canonical text of the rules, so a continuation can check it uses the same ones."""
    return json.dumps([m.SerializeToString().hex() for m in messages])


class CalibratorServicer(pb_grpc.CalibratorServicer):
    def __init__(
        self,
        executor: futures.Executor,
        uploads_store: uploads_lib.UploadStore,
        calibration_store: store_lib.CalibrationStore,
        *,
        max_tensor_bytes: int,
        resolve: Callable[[pb.ModelSpec], tuple[Any, Any]] = registry.resolve,
        limiter: limits.ByteLimiter | None = None,
        # None: programs.DEFAULT_MAX_BYTES (engine/programs/program.py).
        max_program_bytes: int | None = None,
        max_stats_bytes: int | None = None,
        # The server's one LmCalibrations (shared with QuantizeParams, which reads them); None:
        # one of this servicer's own beside the calibration store.
        language_models: language_model.LmCalibrations | None = None,
    ) -> None:
        self._executor = executor
        self._max_stats_bytes = max_stats_bytes
        self._max_program_bytes = max_program_bytes
        self._uploads = uploads_store
        self._calibrations = calibration_store
        self._language_models = language_models or language_model.beside(calibration_store)
        self._max_tensor_bytes = max_tensor_bytes
        self._resolve = resolve
        # Counts the batches held (None: unlimited).
        self._limiter = limiter

    def _previous(self, start: pb.CalibrateStart, tenant: str, keys: tuple[str, str]):
        """The calibration this call continues (None: a new one), made with the same model."""
        if not start.calibration_id:
            return None
        previous = self._calibrations.load(tenant, start.calibration_id)
        if (previous.model_key, previous.rules_key) != keys:
            raise errors.FailedPrecondition(
                f"calibration {start.calibration_id} was made with another model, config, "
                "rules or program; continue it with the same ones, or start a new calibration"
            )
        return previous

    def _prepare_program(self, start: pb.CalibrateStart, tenant: str) -> _Prepared:
        from qmill.engine.programs import program as programs
        from qmill.server.calibrator import program_session

        if start.model.name or start.rules:
            raise ValueError("send either a program or a model with rules, not both")
        if start.return_ptq_params:
            raise ValueError(
                "return_ptq_params needs a registry model; with a program, send the params and "
                "the calibration id to QuantizeParams (static_ranges)"
            )
        max_bytes = self._max_program_bytes
        if max_bytes is None:
            max_bytes = programs.DEFAULT_MAX_BYTES
        data = program_session.program_bytes(
            start.program,
            start.program_upload_id,
            self._uploads.tensors,
            tenant,
            max_bytes,
        )
        program = program_session.load(
            data, max_bytes=max_bytes, platform=jax.devices()[0].platform
        )
        keys = (program_session.model_key(program), "")
        previous = self._previous(start, tenant, keys)
        if not start.params_upload_id:
            raise ValueError("params_upload_id is empty: upload the model's params first")
        params = self._uploads.open_params(tenant, start.params_upload_id)
        return _Prepared(
            session=program_session.ProgramSession(
                program, params, previous, max_stats_bytes=self._max_stats_bytes
            ),
            calibration_id=start.calibration_id or store_lib.CalibrationStore.new_id(),
            model_key=keys[0],
            rules_key=keys[1],
        )

    def _sweep(self) -> None:
        """Each new calibration may need the room the expired ones hold."""
        sweep_expired(self._calibrations, self._language_models)

    def _prepare(self, start: pb.CalibrateStart, tenant: str) -> _Prepared:
        from qmill.server.calibrator import session as session_lib

        self._sweep()
        if start.program or start.program_upload_id:
            return self._prepare_program(start, tenant)
        entry, config = self._resolve(start.model)
        rules = codec.rules_from_proto(start.rules)
        session_lib.check_rules(rules)
        model_key = session_lib.model_key(entry.name, config)
        key = rules_key(start.rules)
        previous = self._previous(start, tenant, (model_key, key))
        if not start.params_upload_id:
            raise ValueError("params_upload_id is empty: upload the model's params first")
        params = self._uploads.open_params(tenant, start.params_upload_id)
        session = session_lib.Session(entry, config, params, rules, previous)
        return _Prepared(
            session=session,
            calibration_id=start.calibration_id or store_lib.CalibrationStore.new_id(),
            model_key=model_key,
            rules_key=key,
        )

    def _finish(self, prep: _Prepared, tenant: str, want_ptq: bool) -> tuple[dict, Any]:
        from qmill.server.calibrator import session as session_lib

        s = prep.session
        stats = s.host_stats()
        self._calibrations.save(
            store_lib.Calibration(
                id=prep.calibration_id,
                tenant=tenant,
                model_key=prep.model_key,
                rules_key=prep.rules_key,
                batches=s.batches,
                examples=s.examples,
                stats=stats,
                stat_qtypes=s.stat_qtypes,
                stat_aliases=s.stat_aliases,
            )
        )
        ptq = []
        if want_ptq:
            ptq = list(session_lib.param_results(s.ptq_params(), s.float_params()))
        return stats, ptq

    @errors.streaming
    async def Calibrate(self, request_iterator, context):
        started = time.monotonic()
        tenant = auth.current_principal().tenant
        loop = asyncio.get_running_loop()
        requests = aiter(request_iterator)
        start = await codec.first_item(requests, "start", "CalibrateStart")
        prep = await loop.run_in_executor(self._executor, self._prepare, start, tenant)
        new_batches = 0
        account = limits.Account(self._limiter, tenant) if self._limiter else None
        # A program's batch is one tensor per model input; a registry model's is one tensor.
        per_batch = getattr(prep.session, "inputs_per_batch", 0)
        try:
            async for arrays, nbytes in _grouped(
                _batches(requests, self._max_tensor_bytes, account), per_batch
            ):
                work = loop.run_in_executor(self._executor, prep.session.add_batch, arrays)
                if account is not None:
                    account.hold_until_done(work)  # the engine reads the bytes until it ends
                await work
                del arrays
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
        for response in _results(stats, ptq):
            yield response
        model_name = start.model.name or "program"
        calls.annotate(model=model_name, batches=new_batches, calibration=prep.calibration_id)
        yield pb.CalibrateResponse(
            summary=pb.CalibrateSummary(
                calibration_id=prep.calibration_id,
                batches_total=prep.session.batches,
                examples_total=prep.session.examples,
                seconds=time.monotonic() - started,
            )
        )

    @errors.streaming
    async def CalibrateLanguageModel(self, request, context):
        """A language model calibrated layer by layer (language_model.py) on the engine
        executor; each finished layer's progress is streamed as it comes."""
        tenant = auth.current_principal().tenant
        loop = asyncio.get_running_loop()
        layers: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()  # the client went away: the calibration stops before a layer

        def progress(p: Any) -> None:
            loop.call_soon_threadsafe(layers.put_nowait, p)

        def check() -> None:
            if stop.is_set():
                raise _Stopped("the call ended; the finished layers are kept for the next one")

        def calibrate() -> language_model.Done:
            self._sweep()
            return self._language_models.calibrate(
                tenant, request, self._uploads.content_path, progress, check
            )

        work = loop.run_in_executor(self._executor, calibrate)
        # A call the client left ends its calibration at the next layer; nobody awaits it then.
        work.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            while not work.done() or not layers.empty():
                waiting = asyncio.ensure_future(layers.get())
                await asyncio.wait({waiting, work}, return_when=asyncio.FIRST_COMPLETED)
                if not waiting.done():
                    waiting.cancel()
                    continue
                yield pb.CalibrateLanguageModelResponse(progress=_lm_progress(waiting.result()))
            done = await work
        finally:
            stop.set()
        calls.annotate(calibration=done.calibration_id, resumed_at=done.resumed_at_layer)
        for name, array in done.folded.items():  # AWQ / SmoothQuant: the folded norms, biases
            for response in _folded(name, array):  # Hadamard: the embedding and head too
                yield response
        yield pb.CalibrateLanguageModelResponse(
            summary=pb.CalibrateLanguageModelSummary(
                calibration_id=done.calibration_id,
                report_json=done.report_json,
                resumed_at_layer=done.resumed_at_layer,
                calibrated_tensors=done.calibrated_tensors,
            )
        )


def _folded(name: str, array: np.ndarray) -> Iterator[pb.CalibrateLanguageModelResponse]:
    """A folded tensor in one message, or, over one chunk (a rotated embedding), its header
    alone and then its bytes chunk by chunk: no message outgrows the client's limit."""
    tensor = codec.inline_tensor(name, array)
    if len(tensor.data) <= wire.CHUNK_BYTES:
        yield pb.CalibrateLanguageModelResponse(folded=tensor)
        return
    yield pb.CalibrateLanguageModelResponse(folded=pb.InlineTensor(header=tensor.header))
    for chunk in wire.chunks(np.frombuffer(tensor.data, np.uint8)):
        yield pb.CalibrateLanguageModelResponse(folded_chunk=chunk)


class _Stopped(Exception):
    """Raised in a language model's calibration whose call ended."""


def _lm_progress(p: Any) -> pb.LanguageModelProgress:
    return pb.LanguageModelProgress(
        layer=p.layer, layers=p.layers, loss=p.loss, seconds=p.seconds, eta_seconds=p.eta_seconds
    )


def _results(stats: dict[str, Any], ptq: list) -> Iterator[pb.CalibrateResponse]:
    """The merged stats, one tensor each, then the PTQ params as QuantizeParams streams them.
    Float params (biases, static activation scales) go as RESULT_KIND_FLOAT with one part,
    'value', whose bytes follow (the client has no copy)."""
    for path, array in params.flatten(stats).items():
        yield from wire.send(pb.CalibrateResponse, "stat", path, array)
    for plan, path, result in ptq:
        if plan is None:
            message, chunks = codec.float_result(path, np.asarray(result))
        else:
            # input_bytes is for reports only, as QuantizeParams' is.
            message, chunks = codec.quantized_result(plan, result, result.qvalue.nbytes)
        yield from codec.messages(pb.CalibrateResponse, "param", message, chunks)


async def _grouped(
    batches: AsyncIterator[tuple[np.ndarray, int]], n: int
) -> AsyncIterator[tuple[Any, int]]:
    """(arrays, bytes) per group of n tensors (n 0: each array alone, as registry models take)."""
    group: list[np.ndarray] = []
    held = 0
    async for array, nbytes in batches:
        if n == 0:
            yield array, nbytes
            continue
        group.append(array)
        held += nbytes
        if len(group) == n:
            yield group, held
            group, held = [], 0
    if group:
        raise ValueError(
            f"the stream ended inside a batch: {len(group)} of the program's {n} input tensors"
        )


async def _batches(
    requests: AsyncIterator[pb.CalibrateRequest], max_bytes: int, account: limits.Account | None
) -> AsyncIterator[tuple[np.ndarray, int]]:
    """(array, bytes reserved) per complete batch; the caller releases the bytes when done."""
    inbox = limits.TensorInbox(max_bytes, account, what="batch")
    async for request in inbox.requests(requests):
        kind = request.WhichOneof("item")
        if kind == "batch":
            await inbox.announce(request.batch)
        elif kind == "chunk":
            await inbox.add(request.chunk)
        elif kind == "start":
            raise ValueError("CalibrateStart must be sent once, as the first message")
        else:
            raise ValueError("empty request: set one of start, batch or chunk")
        for header, array in inbox.take():
            yield array, header.byte_length if account is not None else 0
            del array  # counted as released once the caller asks for the next batch
    inbox.close()
