"""Client and AsyncClient: one channel to a qmill server, a method per service.

    with Client("127.0.0.1:50051") as client:
        for outcome in client.quantize("int8", tensors):
            ...

Every failed call raises errors.QmillError (its gRPC status name and details), whichever service
it was; the per-service logic lives in its module (streaming, uploads, calibrate, export_odml,
jobs) and runs the same on both clients.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from qmill.checkpoints.run import outcome as outcome_lib
from qmill.client import calibrate as calibrate_lib
from qmill.client import connection, errors, recipes, streaming, uploads
from qmill.client import credentials as credentials_lib
from qmill.client import export_odml as export_lib
from qmill.client import jobs as jobs_lib
from qmill.proto.v1 import qmill_pb2 as pb

Tensors = Iterable[tuple[str, np.ndarray]]


class _Base:
    """What both clients share: construction and the connection's properties."""

    _connection_type: Any = connection.Connection

    def __init__(
        self,
        target: str,
        *,
        credentials: credentials_lib.Credentials | None = None,
        timeout: float | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        creds = credentials if credentials is not None else credentials_lib.default()
        self._connection = self._connection_type(target, creds, timeout=timeout, options=options)
        # submit / get / list / watch / cancel batch jobs on the server's own paths
        # (awaitables on an AsyncClient, and watch an async iterator).
        self.jobs = jobs_lib.Jobs(self._connection)

    @property
    def target(self) -> str:
        return self._connection.target

    @property
    def timeout(self) -> float | None:
        return self._connection.timeout

    @property
    def channel(self) -> Any:
        """The grpc.Channel (grpc.aio.Channel), for calls this client has no method for."""
        return self._connection.channel


class Client(_Base):
    """Synchronous qmill client: a context manager owning one channel.

    Args:
        target: HOST:PORT of the server.
        credentials: TLS, token and request id; default plaintext with $QMILL_TOKEN.
        timeout: seconds each call may take (None: no limit; jobs.watch never has one).
        options: gRPC channel options, appended to qmill's own (message sizes).
    """

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._connection.close()

    def capabilities(self) -> pb.GetCapabilitiesResponse:
        """Versions, device, qtypes, calibration methods, models and limits of the server."""
        request = pb.GetCapabilitiesRequest()
        return self._connection.unary("Quantizer", "GetCapabilities", request)

    def quantize(
        self,
        recipe: recipes.Recipe,
        tensors: Tensors,
        *,
        window_bytes: int = streaming.DEFAULT_WINDOW_BYTES,
        static_ranges: pb.StaticRanges | None = None,
    ) -> Iterator[outcome_lib.TensorOutcome]:
        """Quantizes `tensors` (path, array) as `recipe` (a preset name such as "int8", a TOML
        recipe file or a mapping) says; yields outcomes in input order.

        At most `window_bytes` of tensors are sent and not yet answered (one always fits).
        `static_ranges` (a calibration id or statistics) adds the static activation scales of
        static-range quantization, as float outcomes after the tensors'.
        """
        window = streaming.Window(window_bytes)
        sent: dict[str, np.ndarray] = {}
        decoder = streaming.ResponseDecoder(sent)
        failed: list[BaseException] = []
        requests = streaming.requests(recipes.message(recipe), tensors, window, sent, failed)
        requests = calibrate_lib.with_static_ranges(requests, static_ranges)
        outcomes = self._connection.stream(
            "Quantizer", "QuantizeParams", requests, decoder.feed, finish=decoder.check_finished
        )
        try:
            for outcome in outcomes:
                yield outcome
                window.release(outcome.input_bytes)
        except errors.QmillError:
            if failed:  # the call failed because its requests did: say why
                raise failed[0] from None
            raise
        finally:
            window.close()  # first: the request generator may wait for room
            outcomes.close()

    def upload(
        self,
        source: uploads.Source,
        *,
        name: str = "",
        upload_id: str = "",
        chunk_bytes: int = uploads.CHUNK_BYTES,
        retries: int = 5,
        on_sent: Callable[[int], None] | None = None,
    ) -> pb.UploadStatus:
        """Stores a checkpoint (safetensors file, npz or Orbax directory, sent as safetensors read
        one tensor at a time), safetensors `bytes` or an upload_content.Content on the server.

        Content the server already holds is not sent again; a cut stream resumes from the
        committed offset, up to `retries` times. `upload_id` resumes an earlier upload; `name`
        labels bytes; `on_sent` sees the size of each chunk sent.
        """
        with uploads.conversation_of(
            source,
            name,
            upload_id=upload_id,
            chunk_bytes=chunk_bytes,
            retries=retries,
            on_sent=on_sent,
        ) as steps:
            return self._connection.drive(steps)

    def quantize_upload(
        self,
        recipe: recipes.Recipe,
        upload_id: str,
        *,
        static_ranges: pb.StaticRanges | None = None,
    ) -> Iterator[outcome_lib.TensorOutcome]:
        """QuantizeParams on a completed upload: the server reads the tensors, none is streamed.

        Kept tensors come back without an array (the caller has the file it uploaded);
        `static_ranges` as for `quantize`.
        """
        decoder = streaming.ResponseDecoder({})
        requests = uploads.quantize_requests(recipes.message(recipe), upload_id)
        requests = calibrate_lib.with_static_ranges(requests, static_ranges)
        return self._connection.stream(
            "Quantizer", "QuantizeParams", requests, decoder.feed, finish=decoder.check_finished
        )

    def calibrate(
        self,
        start: pb.CalibrateStart,
        batches: Iterable[np.ndarray],
        *,
        on_progress: Callable[[pb.CalibrateProgress], None] | None = None,
    ) -> calibrate_lib.CalibrateResult:
        """Runs one Calibrate call; every array of `batches` is one batch of the model input.

        `on_progress` sees the running totals (over the whole calibration) after each batch.
        """
        collector = calibrate_lib.Collector(on_progress)
        requests = calibrate_lib.requests(start, batches)
        for _ in self._connection.stream("Calibrator", "Calibrate", requests, collector.feed):
            pass
        return collector.result()

    def calibrate_language_model(
        self,
        request: pb.CalibrateLanguageModelRequest,
        *,
        on_progress: Callable[[pb.LanguageModelProgress], None] | None = None,
        on_folded: Callable[[pb.InlineTensor], None] | None = None,
    ) -> pb.CalibrateLanguageModelSummary:
        """Calibrates a Hugging Face causal-LM folder whose weight files are uploaded (no
        timeout: it takes minutes to hours); `on_progress` sees each finished layer, `on_folded`
        each float tensor AWQ / SmoothQuant changed (to write in place of the source's). Its
        summary's calibration_id goes to `quantize(static_ranges=...)`."""
        collector = _LmCollector(on_progress, on_folded)
        stream = self._connection.stream(
            "Calibrator", "CalibrateLanguageModel", request, collector.feed, timeout=None
        )
        for _ in stream:
            pass
        return collector.summary()

    def export_odml(
        self, request: pb.ExportOdmlRequest, output: str | os.PathLike[str]
    ) -> export_lib.ExportResult:
        """Writes the LiteRT model of `request` to `output`, under its name only once whole and
        checked (length and crc32c)."""
        receiver = export_lib.ModelReceiver()
        stream = self._connection.stream(
            "OdmlExporter", "ExportOdml", request, receiver.feed, finish=receiver.check_finished
        )
        for _ in stream:
            pass
        return receiver.write(output)

    def server_info(self) -> pb.ServerInfo:
        """The Admin service: the server's live load and limits (an admin token is needed)."""
        return self._connection.unary("Admin", "GetServerInfo", pb.GetServerInfoRequest())


class AsyncClient(_Base):
    """asyncio qmill client: the same methods as Client, awaited (quantize: async iterators)."""

    _connection_type = connection.AsyncConnection

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._connection.close()

    async def capabilities(self) -> pb.GetCapabilitiesResponse:
        request = pb.GetCapabilitiesRequest()
        return await self._connection.unary("Quantizer", "GetCapabilities", request)

    async def quantize(
        self,
        recipe: recipes.Recipe,
        tensors: Tensors | AsyncIterable[tuple[str, np.ndarray]],
        *,
        window_bytes: int = streaming.DEFAULT_WINDOW_BYTES,
        static_ranges: pb.StaticRanges | None = None,
    ) -> AsyncIterator[outcome_lib.TensorOutcome]:
        """Quantizes `tensors` as `recipe` says; yields outcomes in input order."""
        window = streaming.AsyncWindow(window_bytes)
        sent: dict[str, np.ndarray] = {}
        decoder = streaming.ResponseDecoder(sent)
        requests = streaming.async_requests(recipes.message(recipe), tensors, window, sent)
        requests = calibrate_lib.async_with_static_ranges(requests, static_ranges)
        outcomes = self._connection.stream(
            "Quantizer", "QuantizeParams", requests, decoder.feed, finish=decoder.check_finished
        )
        try:
            async for outcome in outcomes:
                yield outcome
                await window.release(outcome.input_bytes)
        finally:
            await outcomes.aclose()

    async def upload(
        self,
        source: uploads.Source,
        *,
        name: str = "",
        upload_id: str = "",
        chunk_bytes: int = uploads.CHUNK_BYTES,
        retries: int = 5,
        on_sent: Callable[[int], None] | None = None,
    ) -> pb.UploadStatus:
        """As Client.upload (the content's sha256 and its bytes are read on the event loop)."""
        with uploads.conversation_of(
            source,
            name,
            upload_id=upload_id,
            chunk_bytes=chunk_bytes,
            retries=retries,
            on_sent=on_sent,
        ) as steps:
            return await self._connection.drive(steps)

    def quantize_upload(
        self,
        recipe: recipes.Recipe,
        upload_id: str,
        *,
        static_ranges: pb.StaticRanges | None = None,
    ) -> AsyncIterator[outcome_lib.TensorOutcome]:
        decoder = streaming.ResponseDecoder({})
        requests = uploads.quantize_requests(recipes.message(recipe), upload_id)
        requests = calibrate_lib.with_static_ranges(requests, static_ranges)
        return self._connection.stream(
            "Quantizer", "QuantizeParams", requests, decoder.feed, finish=decoder.check_finished
        )

    async def calibrate(
        self,
        start: pb.CalibrateStart,
        batches: Iterable[np.ndarray],
        *,
        on_progress: Callable[[pb.CalibrateProgress], None] | None = None,
    ) -> calibrate_lib.CalibrateResult:
        collector = calibrate_lib.Collector(on_progress)
        requests = calibrate_lib.requests(start, batches)
        async for _ in self._connection.stream("Calibrator", "Calibrate", requests, collector.feed):
            pass
        return collector.result()

    async def calibrate_language_model(
        self,
        request: pb.CalibrateLanguageModelRequest,
        *,
        on_progress: Callable[[pb.LanguageModelProgress], None] | None = None,
        on_folded: Callable[[pb.InlineTensor], None] | None = None,
    ) -> pb.CalibrateLanguageModelSummary:
        collector = _LmCollector(on_progress, on_folded)
        stream = self._connection.stream(
            "Calibrator", "CalibrateLanguageModel", request, collector.feed, timeout=None
        )
        async for _ in stream:
            pass
        return collector.summary()

    async def export_odml(
        self, request: pb.ExportOdmlRequest, output: str | os.PathLike[str]
    ) -> export_lib.ExportResult:
        receiver = export_lib.ModelReceiver()
        stream = self._connection.stream(
            "OdmlExporter", "ExportOdml", request, receiver.feed, finish=receiver.check_finished
        )
        async for _ in stream:
            pass
        return receiver.write(output)

    async def server_info(self) -> pb.ServerInfo:
        return await self._connection.unary("Admin", "GetServerInfo", pb.GetServerInfoRequest())


class _LmCollector:
    """CalibrateLanguageModel's responses: each layer's progress to `on_progress`, each folded
    tensor to `on_folded`, the summary kept."""

    def __init__(
        self,
        on_progress: Callable[[pb.LanguageModelProgress], None] | None,
        on_folded: Callable[[pb.InlineTensor], None] | None = None,
    ) -> None:
        self._on_progress = on_progress
        self._on_folded = on_folded
        self._summary: pb.CalibrateLanguageModelSummary | None = None
        # A folded tensor sent in chunks: its header and the bytes so far.
        self._partial: tuple[pb.TensorHeader, bytearray] | None = None

    def feed(self, response: pb.CalibrateLanguageModelResponse) -> None:
        if response.HasField("progress") and self._on_progress is not None:
            self._on_progress(response.progress)
        elif response.HasField("folded"):
            tensor = response.folded
            if len(tensor.data) < tensor.header.byte_length:  # its bytes follow in chunks
                self._partial = (tensor.header, bytearray(tensor.data))
            elif self._on_folded is not None:
                self._on_folded(tensor)
        elif response.HasField("folded_chunk"):
            self._folded_chunk(response.folded_chunk)
        elif response.HasField("summary"):
            self._summary = response.summary

    def _folded_chunk(self, chunk: pb.TensorChunk) -> None:
        if self._partial is None or chunk.offset != len(self._partial[1]):
            raise errors.QmillError("DATA_LOSS", "a folded tensor's chunk arrived out of order")
        header, data = self._partial
        data += chunk.data
        if len(data) < header.byte_length:
            return
        self._partial = None
        if self._on_folded is not None:
            self._on_folded(pb.InlineTensor(header=header, data=bytes(data)))

    def summary(self) -> pb.CalibrateLanguageModelSummary:
        if self._summary is None:
            raise errors.QmillError("DATA_LOSS", "the calibration ended without its summary")
        return self._summary
