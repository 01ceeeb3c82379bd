"""The Uploads service: a thin adapter over UploadStore (disk work off the event loop)."""

from __future__ import annotations

import asyncio
import logging

from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc
from qmill.server import auth, calls, errors
from qmill.server.uploads import store as store_lib

log = logging.getLogger(__name__)


class UploadsServicer(pb_grpc.UploadsServicer):
    def __init__(self, store: store_lib.UploadStore) -> None:
        self._store = store

    @errors.unary
    async def StartUpload(self, request, context):
        tenant = auth.current_principal().tenant
        status = await asyncio.to_thread(
            self._store.start,
            tenant,
            total_bytes=request.total_bytes,
            sha256=request.sha256,
            fmt=request.format,
            name=request.name,
        )
        calls.annotate(upload_id=status.upload_id, total_bytes=request.total_bytes)
        return status

    @errors.unary
    async def Upload(self, request_iterator, context):
        tenant = auth.current_principal().tenant
        upload_id = ""
        status: pb.UploadStatus | None = None
        received = 0
        async for request in request_iterator:
            if upload_id and request.upload_id != upload_id:
                raise ValueError(
                    f"one Upload call carries one upload; got {request.upload_id!r} after "
                    f"{upload_id!r}"
                )
            upload_id = request.upload_id
            # fsync per chunk: a thread, so other calls keep being served meanwhile.
            status = await asyncio.to_thread(
                self._store.append,
                tenant,
                upload_id,
                request.offset,
                request.data,
                request.crc32c,
            )
            received += len(request.data)
        if status is None:
            raise ValueError("empty Upload stream: send at least one message with the upload id")
        calls.annotate(upload_id=upload_id, bytes=received, complete=status.complete)
        return status

    @errors.unary
    async def QueryUpload(self, request, context):
        tenant = auth.current_principal().tenant
        return await asyncio.to_thread(self._store.query, tenant, request.upload_id)
