"""The Admin service: server-wide information for operators (admin tokens only).

`qmill.v1.Admin/GetServerInfo` answers the live load and the configured limits of this server:
in-flight bytes overall and per tenant, open streams, calls queued for in-flight room. It covers
every tenant, hence admin-only: a user token gets PERMISSION_DENIED.
"""

from __future__ import annotations

from typing import Any

from qmill.proto.v1 import qmill_pb2 as pb
from qmill.proto.v1 import qmill_pb2_grpc as pb_grpc
from qmill.server import auth, errors, limits
from qmill.server import config as config_lib


class AdminServicer(pb_grpc.AdminServicer):
    def __init__(
        self,
        config: config_lib.ServerConfig,
        limiter: limits.ByteLimiter,
        streams: limits.StreamLimitInterceptor,
    ) -> None:
        self._config = config
        self._limiter = limiter
        self._streams = streams

    @errors.unary
    async def GetServerInfo(self, request: pb.GetServerInfoRequest, context: Any) -> pb.ServerInfo:
        auth.require_admin("GetServerInfo")
        return pb.ServerInfo(
            inflight_bytes=self._limiter.used,
            inflight_peak_bytes=self._limiter.peak,
            inflight_bytes_by_tenant=self._limiter.by_tenant,
            active_streams=self._streams.active,
            max_concurrent_streams=self._config.max_concurrent_streams,
            max_inflight_bytes=self._config.max_inflight_bytes,
            max_tenant_inflight_bytes=self._config.max_tenant_inflight_bytes,
            max_tensor_bytes=self._config.max_tensor_bytes,
            max_upload_bytes=self._config.max_upload_bytes,
            waiting_calls=self._limiter.waiting,
        )
